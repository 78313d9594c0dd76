"""A checkpoint converted before it loads (DeepSpeed's universal checkpoint, at another data-parallel size): made
once, from verified bytes, cached beside the checkpoint as a signed checkpoint of its own, bound to its source.

- **From verified bytes only.** The framework's converter unpickles what it reads; it is run on a private copy
  (0700) that rank 0 wrote from the bytes it checked against the source's manifest (pinned by the digest rank 0
  verified) -- never on the source folder by path, where a file swapped after the check would run its code.
- **Bound to its source.** The cache is keyed by the digest of the source's manifest, and its own manifest says
  ``universal_of`` that digest, the source's tag and step; a cached conversion loads only when all three match
  (an older signed conversion copied under the newest digest is converted again, never loaded).
- **A checkpoint of its own.** Its files are hashed, its manifest signed with the run's key and verified before
  every load, each rank reading only bytes it checked (its files are pickles too). Its folders are created 0700,
  never through a planted link.
"""
from __future__ import annotations

import shutil
import uuid
from pathlib import Path

from trainguard.checkpoint.commit import commit_staged
from trainguard.checkpoint.layout import CheckpointError
from trainguard.checkpoint.manifest import Manifest, hash_files, list_files, verify
from trainguard.checkpoint.reader import VerifiedReader
from trainguard.checkpoint.private import own_dir
from trainguard.ranks.isolation import broadcast_from_rank0, rank

CACHE = ".universal"


def bound(target: Path | Manifest, digest: str, tag: str, step: int) -> str | None:
    """Why the conversion at ``target`` (or its manifest, as verified) is not the one of source ``digest`` (``tag`` at
    ``step``), or None."""
    try:
        man = target if isinstance(target, Manifest) else Manifest.read(target)
    except Exception as e:  # noqa: BLE001 - unreadable: not bound
        return f"its manifest does not read: {type(e).__name__}: {e}"
    if man.layout.get("universal_of") != digest:
        return f"it is the conversion of {man.layout.get('universal_of')!r}, not of {digest!r}"
    if man.tag != tag or man.step != step:
        return f"it says {man.tag} at step {man.step}, its source is {tag} at step {step}"
    return None


def converted(cp, root: Path, tag: str, man: Manifest, digest: str, reader: VerifiedReader) -> tuple[Path, VerifiedReader]:
    """Every rank: the conversion of ``root/tag`` (``man``, verified by rank 0 as ``digest``; ``reader`` reads its
    checked bytes) -- made now unless a bound, valid one is cached. Returns (its root, a reader of its verified
    manifest). ``cp``: the checkpoint manager (the key, the state port's ``convert``)."""
    out_root = root / CACHE / digest[:16]
    target = out_root / tag
    error = pinned = None
    if rank() == 0:
        try:
            cached = verify(target, key=cp.key)
            if not (cached.ok and bound(cached.manifest, digest, tag, man.step) is None):
                error = _convert(cp, root, out_root, tag, man, digest, reader)
            if error is None:  # (what is about to be loaded, checked now: the manifest verified, its digest pinned)
                res = verify(target, key=cp.key)
                why = bound(res.manifest, digest, tag, man.step) if res.ok else f"{res.bad_file}: {res.reason}"
                if why is not None:
                    error = f"the conversion {target} cannot be loaded: {why}"
                pinned = res.digest
        except Exception as e:  # noqa: BLE001 - (never before the broadcast: the other ranks wait for it)
            error = f"the conversion of {root / tag} failed: {type(e).__name__}: {e}"
    error, pinned = broadcast_from_rank0((error, pinned))
    if error:
        raise CheckpointError(error)
    return out_root, VerifiedReader(target, pinned, cp.key)  # (each rank loads only what it checked)


def _convert(cp, root: Path, out_root: Path, tag: str, man: Manifest, digest: str, reader: VerifiedReader) -> str | None:
    """Rank 0: the source copied from verified bytes into a private folder, converted there, committed as
    ``out_root/tag`` (hashed, signed, renamed into place). Returns an error text or None."""
    own_dir(root / CACHE)
    own_dir(out_root)
    tmp = own_dir(out_root / f".{tag}.{uuid.uuid4().hex[:6]}", fresh=True)
    try:
        source = own_dir(own_dir(tmp / ".source", fresh=True) / tag, fresh=True)
        for rel in sorted(man.files):
            dest = source / rel
            for folder in reversed(dest.relative_to(source).parents[:-1]):
                own_dir(source / folder)
            dest.write_bytes(reader.read(root / tag / rel))  # (checked against the manifest first)
        error = cp.state.convert(source, tmp / tag)
        if error is not None:
            return f"the conversion of {root / tag} failed:\n{error[-2000:]}"
        shutil.rmtree(tmp / ".source")
        staged = tmp / tag
        converted_man = Manifest(tag=tag, step=man.step, files=hash_files(staged, list_files(staged)),
                                 layout=dict(man.layout, universal_of=digest))
        if (out_root / tag).exists():
            shutil.rmtree(out_root / tag)
        commit_staged(out_root, tmp, tmp.name, converted_man, key=cp.key)
        return None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
