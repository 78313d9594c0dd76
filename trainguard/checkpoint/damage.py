"""The corrupt_checkpoint fault's damage (trainguard.faults names it; the checkpoint manager fires it at its step):
storage rot in the newest committed checkpoint, for tests and drills."""
from __future__ import annotations

from pathlib import Path

from trainguard.checkpoint.layout import CheckpointLayout


def corrupt_newest_checkpoint(root) -> str | None:
    """Flip 64 bytes in the middle of the largest file of the newest committed checkpoint under
    ``root`` (as storage rot would, size unchanged). Returns the file's path, or None."""
    layout = CheckpointLayout(Path(root))
    tags = layout.tags()
    if not tags:
        return None
    files = [p for p in layout.tag_dir(tags[-1]).rglob("*") if p.is_file() and p.stat().st_size > 128]
    if not files:
        return None
    target = max(files, key=lambda p: p.stat().st_size)
    with open(target, "r+b") as f:
        f.seek(target.stat().st_size // 2)
        chunk = f.read(64)
        f.seek(-len(chunk), 1)
        f.write(bytes(b ^ 0xFF for b in chunk))
    return str(target)
