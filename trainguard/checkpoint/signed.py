"""The marks written into a committed checkpoint after its commit -- the stable mark, the post-save trajectory --
bound to their checkpoint's manifest and, with a key (``checkpoint.hmac_key_env``), signed: planted, copied from
another checkpoint or edited, a mark reads as absent (said, never a decision). What the manifest itself says is read
once and trusted only when signed (trainguard.checkpoint.layout.read_manifest). Without a key (no authentication
asked for) marks are taken as written, as before."""
from __future__ import annotations

import hashlib
import hmac
import json
import os
from pathlib import Path

from trainguard.checkpoint.layout import (INDEX, MANIFEST, REPLAYED, STABLE, CheckpointLayout, committed_digests,
                                         index_mac, misplaced, read_manifest, read_optional, read_regular, replaced)


def _mac(key: bytes, name: str, body: dict) -> str:
    payload = json.dumps({k: v for k, v in body.items() if k != "hmac"}, sort_keys=True, separators=(",", ":"))
    return hmac.new(key, f"trainguard-mark\0{name}\0{payload}".encode(), hashlib.sha256).hexdigest()


def write_mark(tag_dir: str | os.PathLike, name: str, payload: dict, key: bytes | None) -> str | None:
    """Write the mark ``name`` (the stable mark, the trajectory) into a committed checkpoint, bound to its manifest
    and, with ``key``, signed -- only when that manifest verifies. Returns why it was not written (None: written)."""
    from trainguard.checkpoint.fsio import atomic_write_json

    tag_dir = Path(tag_dir)
    man = read_manifest(tag_dir, key)
    why = man.why or misplaced(tag_dir, man) or (
        REPLAYED if key is not None and replaced(committed_digests(tag_dir.parent, key), tag_dir.name, man.digest)
        else None)
    if why is not None:
        return f"{tag_dir / MANIFEST}: {why}: the {name} mark is not written"
    body = {**payload, "manifest_sha256": man.digest}
    if key is not None:
        body["hmac"] = _mac(key, name, body)
    atomic_write_json(tag_dir / name, body)
    return None


def read_mark(tag_dir: str | os.PathLike, name: str, key: bytes | None,
              digest: str | None = None) -> tuple[dict | None, str | None]:
    """The mark ``name`` of ``tag_dir`` and why it is ignored: ``(payload, None)`` when it is there and trusted,
    ``(None, None)`` when there is none, ``(None, why)`` when one is there and must be ignored (unsigned, altered,
    copied from another checkpoint, malformed). ``digest``: the sha256 of the manifest the caller trusts (read
    afresh, verified, when not given)."""
    tag_dir = Path(tag_dir)
    raw = read_optional(tag_dir / name)
    if raw is None:
        return None, None
    try:
        body = json.loads(raw)
    except ValueError as e:
        body = e
    if key is None:  # (no authentication: a mark is there or not, as before -- its content read where it parses)
        return (body if isinstance(body, dict) else {}), None
    if not isinstance(body, dict):
        return None, f"{name}: malformed ({body if isinstance(body, ValueError) else 'not a JSON object'}): ignored"
    if digest is None:
        man = read_manifest(tag_dir, key)
        if man.why is not None:
            return None, f"{name}: its checkpoint's manifest does not verify ({man.why}): ignored"
        digest = man.digest
    mac = body.get("hmac")
    if not isinstance(mac, str) or not hmac.compare_digest(mac.encode(), _mac(key, name, body).encode()):
        return None, f"{name}: unsigned or altered (no valid HMAC with this run's key): ignored"
    if body.get("manifest_sha256") != digest:
        return None, f"{name}: signed for another manifest (copied from another checkpoint?): ignored"
    return body, None


def stable(layout: CheckpointLayout, tag: str, digest: str | None = None) -> bool:
    """Whether ``tag`` of ``layout`` carries a stable mark the run trusts (with the layout's key: signed for the
    manifest its listing verified, or ``digest``'s)."""
    mark, _ = read_mark(layout.tag_dir(tag), STABLE, layout.key, digest or layout.digests.get(tag))
    return mark is not None


def resign_marks(tag_dir: str | os.PathLike, old_key: bytes | None, key: bytes, digest: str) -> list[str]:
    """After its manifest was signed with ``key`` (trainguard ckpt sign): the marks that ``old_key`` signed for that
    manifest (``digest``) -- or, turning authentication on (no ``old_key``), the marks as written -- signed with
    ``key``; a mark the old key did not sign for this manifest is left as it is (it reads as absent). Returns the
    marks signed."""
    from trainguard.checkpoint.layout import TRAJECTORY

    done = []
    for name in (STABLE, TRAJECTORY):
        mark, _ = read_mark(tag_dir, name, old_key, digest)
        if mark is not None and write_mark(tag_dir, name, {k: v for k, v in mark.items()
                                                           if k not in ("hmac", "manifest_sha256")}, key) is None:
            done.append(name)
    return done


def staged_digest(staged: Path) -> str:
    """The sha256 of the manifest just written into the (0700) staging folder: what the index records."""
    return hashlib.sha256(read_regular(Path(staged) / MANIFEST)).hexdigest()


def record_commit(root: Path, tag: str, key: bytes | None, digest: str | None = None) -> None:
    """After ``tag`` was committed under ``root`` (rank 0, with a key): its manifest's digest into the root's signed
    index, in a 0700 folder of the job's own (trainguard.checkpoint.private.own_dir) -- what tells a signed manifest
    committed now from an older signed copy of the same tag put back later (a signature says what was written, not
    when). ``digest``: the manifest's, hashed before the rename (read back from ``root`` when not given). Entries whose
    folder is gone are dropped. A folder that is not the job's own: said, the index not kept."""
    import logging

    from trainguard.checkpoint.private import UnsafeFolder, own_dir

    if key is None:
        return
    root = Path(root)
    try:
        folder = own_dir(root / Path(INDEX).parent)
    except (UnsafeFolder, OSError) as e:
        logging.getLogger("trainguard").warning("trainguard: %s: the index of committed checkpoints is not kept", e)
        return
    digests = {t: d for t, d in committed_digests(root, key).items() if os.path.isdir(root / t)}
    digests[tag] = digest or staged_digest(root / tag)
    _write_index(folder / Path(INDEX).name, digests, key)


def resign_index(root: Path, old_key: bytes | None, key: bytes) -> bool:
    """A key rotation: the index the old key signed, signed with the new one (True); nothing else is trusted."""
    digests = committed_digests(Path(root), old_key) if old_key is not None else {}
    if not digests:
        return False
    _write_index(Path(root) / INDEX, digests, key)
    return True


def _write_index(path: Path, digests: dict[str, str], key: bytes) -> None:
    from trainguard.checkpoint.fsio import atomic_write_json

    atomic_write_json(path, {"digests": digests, "hmac": index_mac(key, digests)}, mode=0o600)
