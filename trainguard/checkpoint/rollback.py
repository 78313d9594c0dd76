"""Which checkpoint a rollback returns to, and what it sets aside -- one rank's filesystem view
(rank 0 decides; the adapters broadcast the answer and emit the events)."""
from __future__ import annotations

import os
import uuid
from pathlib import Path

from trainguard.checkpoint.fsio import atomic_write_text, fsync_dir
from trainguard.checkpoint.layout import LATEST, STABLE, CheckpointLayout
from trainguard.checkpoint.manifest import verify


def fitting_after(root: Path, key: str, value) -> int:
    """The first step from which checkpoints fit a run whose manifest layout says ``key: value``:
    one past the newest checkpoint that says otherwise (0 when none does; a checkpoint that does
    not say is taken to fit). For ``not_before`` of :func:`choose_rollback` -- e.g. after a bf16
    fallback, where the fp16 checkpoints before it do not load any more."""
    from trainguard.checkpoint.manifest import Manifest

    layout = CheckpointLayout(root)
    floor = 0
    for tag, step in layout.steps():
        try:
            had = Manifest.read(layout.tag_dir(tag)).layout  # (DeepSpeed's manifests before stop 42 say "dtype")
            said = had.get(key, had.get("dtype", value) if key == "precision" else value)
        except Exception:  # (unreadable: choose_rollback verifies it and reports it)
            continue
        if said != value:
            floor = max(floor, step + 1)
    return floor


def choose_rollback(root: Path, onset: int, mode: str, not_before: int = 0,
                    inclusive: bool = False, key: bytes | None = None) -> tuple[str | None, str, list[dict]]:
    """The newest checkpoint from before ``onset`` that verifies, stable if ``mode`` is "stable"
    (else, or failing that, the newest valid one). ``inclusive``: one saved at ``onset`` itself
    qualifies (that step was skipped, so its state is the state before the anomaly).
    ``not_before``: older checkpoints do not fit the engine any more (a precision change).
    Returns ``(tag or None, why, [newer invalid ones: {tag, bad_file, reason, dir}])``."""
    layout = CheckpointLayout(root)
    seen = []  # (tag, verify result), newest first
    for tag, step in reversed(layout.steps()):
        if not_before <= step < onset + (1 if inclusive else 0):
            seen.append((tag, verify(layout.tag_dir(tag), key=key)))
    valid = [t for t, res in seen if res.ok]
    stable = [t for t in valid if (layout.tag_dir(t) / STABLE).exists()]
    if mode == "stable" and stable:
        chosen, why = stable[0], "newest stable checkpoint before the onset"
    elif valid:
        chosen, why = valid[0], "newest valid checkpoint before the onset" + (
            " (none was stable yet)" if mode == "stable" else "")
    else:
        chosen, why = None, f"no valid checkpoint in {root} predates step {onset}"
    bad = layout.passed_over()
    for tag, res in seen:  # the invalid ones newer than the choice: say why they were passed over
        if tag == chosen:
            break
        if res.io_error:  # (no rollback past a storage error: it would set that checkpoint aside)
            return None, f"{tag}: {res.bad_file}: {res.reason}: no rollback past it", [
                {"tag": tag, "bad_file": res.bad_file, "reason": res.reason, "dir": str(root), "io_error": True}]
        if not res.ok:
            bad.append({"tag": tag, "bad_file": res.bad_file, "reason": res.reason, "dir": str(root)})
    return chosen, why, bad


def abandon_after(root: Path, step: int) -> list[str]:
    """After a rollback to ``step``: checkpoints of the abandoned trajectory move to ``.abandoned/``
    (never deleted here), so that no later resume picks them (they may hold the damage)."""
    layout = CheckpointLayout(root)
    moved = []
    for tag, saved_at in layout.steps():
        if saved_at > step:
            from trainguard.checkpoint.private import own_dir

            dest = own_dir(root / ".abandoned") / f"{tag}.{uuid.uuid4().hex[:6]}"  # (never a planted link)
            os.replace(layout.tag_dir(tag), dest)
            moved.append(tag)
    if moved:
        fsync_dir(root)
        remaining = layout.tags()
        if remaining:
            atomic_write_text(root / LATEST, remaining[-1])
    return moved
