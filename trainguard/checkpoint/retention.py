"""Which committed checkpoints may go: never before a newer one is committed, never one of the
newest ``keep_stable`` stable ones, and always keeping the newest ``keep_last``."""
from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path


_SAID: set = set()  # (folder, tag) already named in the log


def to_delete(tags_oldest_first: list[str], stable: set[str], keep_last: int, keep_stable: int) -> list[str]:
    keep = set(tags_oldest_first[-keep_last:]) if keep_last > 0 else set()
    stable_order = [t for t in tags_oldest_first if t in stable]
    keep |= set(stable_order[-keep_stable:]) if keep_stable > 0 else set()
    return [t for t in tags_oldest_first if t not in keep]


def apply(root: Path, keep_last: int, keep_stable: int, key: bytes | None = None) -> list[str]:
    """Rank 0, after a commit: the doomed checkpoints renamed into staging (gone from the listing at once), then
    deleted -- a crash never leaves a half-deleted one that looks committed. Returns their tags. With ``key``, only
    checkpoints whose manifest verifies count, by the step they sign, and only signed stable marks: what a writer
    without the key planted never deletes one (and is never deleted here: it is named at the next load)."""
    from trainguard.checkpoint.commit import STAGING_HELD, leave_staging
    from trainguard.checkpoint.layout import STAGING, CheckpointLayout
    from trainguard.checkpoint.private import own_dir
    from trainguard.checkpoint.signed import stable as is_stable

    layout = CheckpointLayout(root, key)
    tags = layout.tags()
    for p in layout.passed_over():  # (named once per folder and tag: kept, never a reason to delete a verified one)
        if (str(root), p["tag"]) not in _SAID:
            _SAID.add((str(root), p["tag"]))
            logging.getLogger("trainguard").warning("trainguard: %s/%s: %s (retention keeps it and counts it for "
                                                    "nothing)", root, p["tag"], p["reason"])
    stable = {t for t in tags if is_stable(layout, t)}
    doomed = to_delete(tags, stable, keep_last, keep_stable)
    for t in doomed:
        with STAGING_HELD:  # (.staging made and used before a commit's leave_staging may remove it)
            trash = own_dir(layout.root / STAGING) / f"deleted.{t}.{uuid.uuid4().hex[:6]}"
            os.replace(layout.tag_dir(t), trash)
        shutil.rmtree(trash, ignore_errors=True)
    if doomed:
        leave_staging(layout.root)
    return doomed
