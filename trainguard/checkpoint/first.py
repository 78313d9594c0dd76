"""The first step's checkpoint (``checkpoint.first_step``), as functions of the checkpoint manager (``cp``): saved
after a fresh run's first step into ``dir/.first`` (the same commit protocol; resume and retention never see it),
the target of a young run's restart (trainguard.recovery.lrcut), removed once the run has grown (FIRST_KEPT)."""
from __future__ import annotations

import shutil
import uuid
from pathlib import Path

from trainguard.checkpoint.layout import CheckpointError
from trainguard.checkpoint.rollback import choose_rollback
from trainguard.events import Record
from trainguard.ranks.isolation import broadcast_from_rank0, rank
from trainguard.decisions import SETTLE, YOUNG

FIRST = ".first"  # dir/.first: the first step's checkpoint (checkpoint.first_step)
FIRST_KEPT = 4 * YOUNG * SETTLE  # without the guard's LR history: the first step's checkpoint is removed at this step


def first_root(cp) -> Path | None:
    return Path(cp.cfg.dir) / FIRST if cp.cfg.dir else None


def on_step(cp, step: int) -> None:
    """After a fresh run's first step: a checkpoint apart from the periodic ones (checkpoint.first_step). Once
    the run has grown (trainguard.recovery.lrcut.LrHistory.grown: past the young horizon and the settling time a verdict takes
    after it): removed (a restart from it is for a climb that began young)."""
    if step == 1:
        save_first(cp)
    elif not cp._first_dropped and cp.pending_tag() is None:  # (once per process: a run resumed past FIRST_KEPT
        # drops it too; never under its own background write -- a save in flight is every rank's alike)
        cp._first_dropped = True
        drop_first(cp)


def save_first(cp) -> None:
    """Insurance, off the step's critical path: written in the background from host copies -- the adapter's capture
    (DeepSpeed's), or where its framework's save is a collective (megatron's dist_checkpointing), each rank's own
    state at this layout (``State.capture_local``: only this run's restart loads it) --, whatever
    ``checkpoint.async`` says of the periodic saves; committed at the next step's end, waited for by a restart."""
    roots = dict(cp.roots)
    tag = cp.save(first_root(cp), asynchronous=True, local=True)
    # (no stable mark or trajectory for it: a restart takes it as it is, and resume never sees it -- and the
    # main directory's checkpoint of the same tag, if any, keeps its own watch and root)
    mine = next((w for w in reversed(cp.health.watching) if w.tag == tag), None)
    cp.health.watching = [w for w in cp.health.watching if w is not mine]
    if tag in roots:
        cp.roots[tag] = roots[tag]
    else:
        cp.roots.pop(tag, None)


def drop_first(cp) -> None:
    root = first_root(cp)
    if rank() == 0 and root.exists():
        trash = root.with_name(f"{FIRST}.deleted.{uuid.uuid4().hex[:6]}")
        root.rename(trash)  # (gone from its place at once; a crash leaves no half-deleted one there)
        shutil.rmtree(trash, ignore_errors=True)


def after_restart(cp) -> None:
    """After a restart from the first step: a checkpoint of the run's new start at once (the periodic ones were
    set aside with the abandoned trajectory; a crash before the next save would start the run afresh, its
    lowered LR and its one restart forgotten). Insurance: one that cannot be written (megatron's distributed optimizer
    restored to before its first update) is a ``checkpoint_failed`` record, never the run's death."""
    if cp.cfg.dir:
        cp.insure(cp.step_count(), Path(cp.cfg.dir), lambda: cp.save(cp.cfg.dir))


def refresh_first(cp) -> None:
    """After a restart from the first step that changed the precision (fp16 -> bf16): the first step's checkpoint
    again, in the precision the run goes on in (the fp16 one would not load any more)."""
    if cp.cfg.dir and cp.cfg.first_step:
        drop_first(cp)
        save_first(cp)


def first_target(cp) -> tuple[Path | None, str | None, str]:
    """The first step's checkpoint, verified, when it fits the run (every rank learns)."""
    cp.wait_pending()  # (every rank: a first step's save still in flight is committed first)
    root = first_root(cp)
    floor = cp.not_before(root) if root is not None else 0  # (every rank: a collective)
    choice = None
    if rank() == 0:
        try:  # (rank 0 never raises before the broadcast: the others would wait for it)
            choice = (None, "no checkpoint of the first step", []) if root is None or not root.exists() else \
                choose_rollback(root, 1, "latest_valid", floor, inclusive=True, key=cp.key,
                                skip=cp.unloadable)
        except (OSError, CheckpointError) as e:  # (a StorageError too: no verdict, no rollback chosen on it)
            choice = (None, f"the first step's checkpoint could not be listed: {e}", [])
    tag, why, bad = broadcast_from_rank0(choice)
    for b in bad:
        cp.emit(cp.step_count(), Record.CHECKPOINT_INVALID, b)
    return (root if tag is not None else None), tag, why
