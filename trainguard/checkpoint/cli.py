"""``trainguard ckpt list|verify|inspect``: look at a checkpoint directory without a framework."""
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
        ok = "ok" if res.ok else f"BAD: {res.bad_file}: {res.reason}"
        mark = " <- latest" if tag == latest else ""
        print(f"{tag:<22}{man.step if man else '?':>8}  {stable:<7}{_size(man.total_bytes) if man else '?':>10}  {ok}{mark}")
    return 0


def ckpt_verify(root: str, tag: str | None = None, key: bytes | None = None) -> int:
    layout = CheckpointLayout(root)
    tags = [tag] if tag else layout.tags()
    if not tags:
        print(f"{root}: no committed checkpoints", file=sys.stderr)
        return 1
    bad = 0
    for t in tags:
        res = verify(layout.tag_dir(t), key=key)
        if res.ok:
            print(f"{t}: OK ({len(res.manifest.files)} files, {_size(res.manifest.total_bytes)})")
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
