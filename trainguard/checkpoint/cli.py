"""``trainguard ckpt list|verify|inspect|sign``: look at a checkpoint directory without a framework."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from trainguard.checkpoint.layout import LATEST, STABLE, TRAJECTORY, CheckpointLayout
from trainguard.checkpoint.manifest import Manifest, verify


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def ckpt_list(root: str, checksums: bool = True) -> int:
    layout = CheckpointLayout(root)
    tags = layout.tags()
    if not tags:
        print(f"{root}: no committed checkpoints")
        return 0
    latest = layout.latest()
    print(f"{'tag':<22}{'step':>8}  {'stable':<7}{'size':>10}  verified")
    for tag in tags:
        res = verify(layout.tag_dir(tag), checksums=checksums)
        man = res.manifest
        stable = "yes" if (layout.tag_dir(tag) / STABLE).exists() else "no"
        ok = f"ok ({_signed(layout.tag_dir(tag), None)})" if res.ok else f"BAD: {res.bad_file}: {res.reason}"
        mark = " <- latest" if tag == latest else ""
        print(f"{tag:<22}{man.step if man else '?':>8}  {stable:<7}{_size(man.total_bytes) if man else '?':>10}  {ok}{mark}")
    return 0


def _chosen(root: str, tag: str | None) -> tuple[CheckpointLayout, list[str]]:
    """The layout and the tags a command acts on (``tag`` alone, or every committed one); none: said on stderr."""
    layout = CheckpointLayout(root)
    tags = [tag] if tag else layout.tags()
    if not tags:
        print(f"{root}: no committed checkpoints", file=sys.stderr)
    return layout, tags


def ckpt_verify(root: str, tag: str | None = None, key: bytes | None = None) -> int:
    layout, tags = _chosen(root, tag)
    if not tags:
        return 1
    bad = 0
    for t in tags:
        res = verify(layout.tag_dir(t), key=key)
        if res.ok:
            print(f"{t}: OK ({len(res.manifest.files)} files, {_size(res.manifest.total_bytes)}; "
                  f"{_signed(layout.tag_dir(t), key)})")
        else:
            bad += 1
            print(f"{t}: BAD: {Path(root) / t / res.bad_file}: {res.reason}")
    return 1 if bad else 0


def ckpt_inspect(root: str, tag: str) -> int:
    d = CheckpointLayout(root).tag_dir(tag)
    try:
        man = Manifest.read(d)
    except (OSError, ValueError) as e:
        print(f"{d}: no readable manifest ({e})", file=sys.stderr)
        return 1
    out = {"tag": man.tag, "step": man.step, "created": man.created, "layout": man.layout,
           "lineage": man.lineage, "health": man.health,
           "stable": json.loads((d / STABLE).read_text()) if (d / STABLE).exists() else None,
           "trajectory_after_save": json.loads((d / TRAJECTORY).read_text())["losses"]
           if (d / TRAJECTORY).exists() else None,
           "latest": (Path(root) / LATEST).read_text().strip() == tag if (Path(root) / LATEST).exists() else False,
           "files": {k: v["size"] for k, v in man.files.items()}, "total_bytes": man.total_bytes}
    print(json.dumps(out, indent=1))
    return 0


def _signed(tag_dir: Path, key: bytes | None) -> str:
    """How a verified checkpoint stands with authentication: an unsigned one must never read as if checked."""
    from trainguard.checkpoint.auth import SIGNATURE

    if key is not None:
        return "signature valid"
    return "signed, signature not checked: give --key-env" if (tag_dir / SIGNATURE).is_file() else "unsigned"


def ckpt_sign(root: str, key: bytes, tag: str | None = None, old_key: bytes | None = None) -> int:
    """Sign committed checkpoints for a job that turns authentication on (checkpoint.hmac_key_env): each is
    verified against its sha256 manifest first (a checkpoint that does not verify is never signed). One signed with
    another key is signed anew only in a key rotation (``old_key``): verified with the old key first -- its signature
    and every file's sha256 -- and the exact manifest bytes verified signed with the new one (never a manifest any
    writer of the folder could have rewritten to match planted files)."""
    import os

    from trainguard.checkpoint.auth import SIGNATURE, problem, sign_verified
    from trainguard.checkpoint.layout import CheckpointError
    from trainguard.checkpoint.signed import resign_index, resign_marks

    layout, tags = _chosen(root, tag)
    if not tags:
        return 1
    bad = 0
    for t in tags:
        d = layout.tag_dir(t)
        signed = os.path.lexists(d / SIGNATURE)
        if signed and problem(d, key) is None:
            marks = resign_marks(d, old_key, key, verify(d, key=key).digest) if old_key is not None else []
            print(f"{t}: already signed with this key{'; marks signed: ' + ', '.join(marks) if marks else ''}")
            continue
        if not signed and old_key is not None:  # (a rotation signs only what the old key signed)
            bad += 1
            print(f"{t}: NOT SIGNED: it carries no signature of the old key (sign it without --old-key-env if you "
                  "trust it as it is)")
            continue
        if signed and old_key is None:
            bad += 1
            print(f"{t}: NOT SIGNED: it carries a signature of another key (a key rotation: give --old-key-env, "
                  "the variable holding the key it was signed with)")
            continue
        res = verify(d, key=old_key if signed else None)
        if not res.ok:
            bad += 1
            print(f"{t}: NOT SIGNED: {d / str(res.bad_file)}: {res.reason}")
            continue
        try:
            sign_verified(d, key, res.digest)
            marks = resign_marks(d, old_key, key, res.digest)
        except (OSError, CheckpointError) as e:
            bad += 1
            print(f"{t}: NOT SIGNED: {e}")
            continue
        print(f"{t}: signed ({len(res.manifest.files)} files verified{' with the old key' if signed else ''}"
              f"{'; marks signed: ' + ', '.join(marks) if marks else ''})")
    if old_key is not None and resign_index(layout.root, old_key, key):
        print("the index of committed checkpoints (.index/): verified with the old key, signed with the new one")
    return 1 if bad else 0
