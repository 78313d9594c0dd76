"""Which checkpoint a rollback returns to, and what it sets aside -- one rank's filesystem view
(rank 0 decides: :func:`fitting_after`, :func:`choose_rollback`, :func:`abandon_after`), then the same on
every rank, as functions of the checkpoint manager (``cp``: trainguard.checkpoint.manager.CheckpointManager):
rank 0's answer broadcast and its records emitted, the newest valid tier (a snapshot in node memory when one
is newer than the disk's choice), and the abandoned trajectory dropped from both tiers."""
from __future__ import annotations

import os
import uuid
from pathlib import Path

from trainguard.checkpoint.fsio import atomic_write_text, fsync_dir
from trainguard.checkpoint.layout import LATEST, CheckpointError, CheckpointLayout, io_entry, valid_tag
from trainguard.checkpoint.manifest import verify
from trainguard.checkpoint.signed import stable as is_stable
from trainguard.checkpoint.snapshots import disk_tag, memory_tag, snapshot_step
from trainguard.events import Record
from trainguard.ranks.isolation import broadcast_from_rank0, rank


def fitting_after(root: Path, field: str, value, key: bytes | None = None) -> int:
    """The first step from which checkpoints fit a run whose manifest layout says ``field: value``:
    one past the newest checkpoint that says otherwise (0 when none does; a checkpoint that does
    not say is taken to fit). For ``not_before`` of :func:`choose_rollback` -- e.g. after a bf16
    fallback, where the fp16 checkpoints before it do not load any more. With ``key``: what signed manifests say
    (an unsigned one decides nothing)."""
    layout = CheckpointLayout(root, key)
    floor = 0
    for tag, step in layout.steps():
        had = layout.data.get(tag, {}).get("layout")  # (the bytes the listing verified: never read again)
        if not isinstance(had, dict):  # (unreadable: choose_rollback verifies it and reports it)
            continue
        said = had.get(field, had.get("dtype", value) if field == "precision" else value)  # (before stop 42: dtype)
        if said != value:
            floor = max(floor, step + 1)
    return floor


def target_key(root: Path, tag: str) -> str:
    """A rollback target's name among those that failed to load in this process (``cp.unloadable``; a node-memory
    snapshot's ``memory:`` tag is its own)."""
    return tag if tag.startswith("memory:") else f"{root}/{tag}"


def choose_rollback(root: Path, onset: int, mode: str, not_before: int = 0, inclusive: bool = False,
                    key: bytes | None = None, skip: frozenset | set = frozenset()) -> tuple[str | None, str, list[dict]]:
    return choose_with_step(root, onset, mode, not_before, inclusive, key, skip)[:3]


def choose_with_step(root: Path, onset: int, mode: str, not_before: int = 0,
                     inclusive: bool = False, key: bytes | None = None,
                     skip: frozenset | set = frozenset()) -> tuple[str | None, str, list[dict], int]:
    """The newest checkpoint from before ``onset`` that verifies, stable if ``mode`` is "stable"
    (else, or failing that, the newest valid one). ``inclusive``: one saved at ``onset`` itself
    qualifies (that step was skipped, so its state is the state before the anomaly).
    ``not_before``: older checkpoints do not fit the engine any more (a precision change). ``skip``: targets that
    failed to load in this process (:func:`target_key`), passed over.
    Returns ``(tag or None, why, [newer invalid ones: {tag, bad_file, reason, dir}])`` (:func:`choose_rollback`), and
    the chosen one's step as the listing read it (-1: none) -- the manifest is not read again."""
    layout = CheckpointLayout(root, key)
    seen = []  # (tag, verify result), newest first
    listed = layout.steps()
    for tag, step in reversed(listed):
        if not_before <= step < onset + (1 if inclusive else 0) and target_key(root, tag) not in skip:
            seen.append((tag, verify(layout.tag_dir(tag), key=key)))
    valid = [t for t, res in seen if res.ok]
    digest = {t: res.digest for t, res in seen}
    stable = [t for t in valid if is_stable(layout, t, digest[t])]  # (bound to the manifest verify read)
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
                {"tag": tag, "bad_file": res.bad_file, "reason": res.reason, "dir": str(root), "io_error": True}], -1
        if not res.ok:
            bad.append({"tag": tag, "bad_file": res.bad_file, "reason": res.reason, "dir": str(root)})
    return chosen, why, bad, dict(listed).get(chosen, -1) if chosen else -1


def abandon_after(root: Path, step: int, key: bytes | None = None) -> list[str]:
    """After a rollback to ``step``: checkpoints of the abandoned trajectory move to ``.abandoned/``
    (never deleted here), so that no later resume picks them (they may hold the damage). With ``key``: those whose
    signed manifest says a later step (an unsigned one is never moved on what it says)."""
    layout = CheckpointLayout(root, key)
    moved = []
    # (a fresh start, step -1: every committed folder, verified or not -- a move, not a decision on its bytes; a later
    # save of the same tag would otherwise replace one another key signed)
    listed = [(t, 0) for t in layout.committed() if valid_tag(t)] if step < 0 else layout.steps()
    for tag, saved_at in listed:
        if saved_at > step:
            from trainguard.checkpoint.private import keep_aside  # (never into a planted link)

            keep_aside(layout.tag_dir(tag), root / ".abandoned", f"{tag}.{uuid.uuid4().hex[:6]}")
            moved.append(tag)
    if moved:
        fsync_dir(root)
        remaining = layout.tags()
        if remaining:
            atomic_write_text(root / LATEST, remaining[-1])
        elif (root / LATEST).is_file():  # (DeepSpeed's own pointer must not name a tag set aside)
            os.unlink(root / LATEST)
    return moved


# ---------------------------------------------------------------------- every rank (the checkpoint manager's)
def rollback_target(cp, root: Path, onset: int, mode: str, inclusive: bool = False) -> tuple[str | None, str, int]:
    """Rank 0 chooses on disk (:func:`choose_rollback`), every rank learns; then the newest valid tier: a
    snapshot in memory when one is newer than the disk's choice (in "stable" mode, one this process saw become
    stable: ``stable_after`` clean steps after it). Returns the tag, why, and its step (-1: none chosen)."""
    floor = cp.not_before(root)
    choice = None
    if rank() == 0:
        try:
            choice = choose_with_step(root, onset, mode, floor, inclusive, key=cp.key, skip=cp.unloadable)  # (signed)
        except (OSError, CheckpointError) as e:  # (never before the broadcast: the others wait for it) no rollback
            choice = (None, str(e), [io_entry(e, root)], -1)
    tag, why, bad, disk_step = broadcast_from_rank0(choice)
    for b in bad:
        cp.emit(cp.step_count(), Record.CHECKPOINT_INVALID, b)
    disk_step = disk_step if tag is not None and disk_step is not None else -1
    if cp.snapshots is None:
        return tag, why, disk_step
    only = {disk_tag(t)[0] for t in cp.stable_snapshots} if mode == "stable" else None
    found = cp.snapshots.choose(lo=max(disk_step + 1, floor),
                                hi=onset + (1 if inclusive else 0), only=only)
    if found is None or memory_tag(found[0]) in cp.unloadable:
        return tag, why, disk_step
    return (memory_tag(found[0]), f"newest {'stable ' if mode == 'stable' else ''}snapshot in memory before the onset",
            snapshot_step(found[0]))


def abandon_trajectory(cp, root: Path, step: int) -> list[str]:
    """After a rollback to ``step``, every rank: the abandoned trajectory's checkpoints are set aside
    (:func:`abandon_after`, rank 0), its snapshots in memory dropped, and the health watches, stable
    snapshots and the pacer forget its steps."""
    outcome = None
    if rank() == 0:
        try:
            outcome = (abandon_after(root, step, cp.key), None)
        except Exception as e:  # noqa: BLE001 - (never before the broadcast: the others wait for it)
            outcome = ([], f"{type(e).__name__}: {e}")
    cp.health.watching = [w for w in cp.health.watching if w.step <= step]
    cp.stable_snapshots = {t for t in cp.stable_snapshots if snapshot_step(t) <= step}
    cp.saver.losses = {s: loss for s, loss in cp.saver.losses.items() if s <= step}  # (the abandoned steps' go)
    cp.pacer.rewind(step)
    if cp.snapshots is not None:
        cp.snapshots.wait()
        cp.snapshots.store.drop_after(step)
    moved, error = broadcast_from_rank0(outcome)
    if error:
        raise CheckpointError(f"trainguard: the checkpoints after step {step} in {root} could not be set aside: "
                              f"{error}")
    return moved


def not_before(cp, root: Path) -> int:
    """Every rank: checkpoints older than this step do not fit the run any more (0: all fit) -- those of another
    precision, where the framework cannot load them (after a bf16 fallback); read by rank 0
    (:func:`fitting_after`), learnt by all."""
    if not cp.state.precision_bound():
        return 0
    floor = None
    if rank() == 0:
        try:
            floor = fitting_after(root, "precision", cp.state.layout().get("precision"), cp.key)
        except Exception:  # noqa: BLE001 - (never before the broadcast: the others wait for it) every one verifies
            floor = 0
    return broadcast_from_rank0(floor)
