"""The checkpoint manager: one protocol for every framework.

What it owns (framework-free): periodic saves (``checkpoint.every_steps``), retention
(``keep_last`` + the newest ``keep_stable`` stable ones), stable marks and the post-save
trajectory (health.py), the resume choice (the newest checkpoint that verifies, or the newest
stable one) and the resume at start, rollback targets and what a rollback abandons, the resume
self-test, and every record about checkpoints. Who calls what: every rank calls every public
method together; rank 0 alone reads and changes the directory listing and broadcasts its answer.

The commit protocol, sync and async, and the manifest are the core's too (trainguard.checkpoint.saving), as are
the conversion cache (trainguard.checkpoint.conversion) and the sidecars (RNG, data position, merged across the
old ranks when a resume reshards). An adapter is not a subclass: it hands its framework's state as a
:class:`trainguard.protocols.State` -- framework calls only (write, capture, load, layout) -- and the manager
does the rest, the same way for every framework.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from trainguard.checkpoint import auth, first, loading, resume, rollback
from trainguard.checkpoint.first import FIRST, FIRST_KEPT
from trainguard.checkpoint.fsio import beat_from_training_thread
from trainguard.checkpoint.health import CheckpointHealth, ResumeCheck
from trainguard.checkpoint.layout import STABLE, TRAJECTORY, CheckpointError, step_tag
from trainguard.checkpoint.pacing import SnapshotPacer
from trainguard.checkpoint.retention import apply as apply_retention
from trainguard.checkpoint.saving import Saver
from trainguard.checkpoint.signed import write_mark
from trainguard.checkpoint.runid import RUN_ID
from trainguard.checkpoint.rollback import target_key
from trainguard.checkpoint.snapshots import MEMORY, memory_tag, snapshot_step
from trainguard.events import Record
from trainguard.ranks.isolation import barrier, failures_of, rank, world

__all__ = ["CheckpointManager", "FIRST", "FIRST_KEPT", "barrier", "rank", "world"]


class CheckpointManager:
    """One per rank, over the adapter's :class:`trainguard.protocols.State` (``state``). ``cfg``: the whole block;
    ``guard``: the StepGuard (records, its state); ``faults``, ``goodput``: the session's (the checkpoint faults, a
    save's overhead); ``heart``: the rank's heartbeat (saves and loads count as progress)."""

    def __init__(self, cfg, guard, heart, state, faults, goodput, lr_history=None, on_resume=None):
        self.state = state
        self.block = cfg
        self.cfg = cfg.checkpoint
        self.guard = guard
        self.faults = faults if cfg.faults else None  # trainguard.faults.injector.FaultInjector (the checkpoint faults)
        self.goodput = goodput                        # trainguard.observe.goodput.GoodputMeter (a save's overhead)
        self.heart = heart
        self.health = CheckpointHealth(self.cfg.stable_after, self.cfg.verify_steps)
        self.resume_check: ResumeCheck | None = None
        self.roots: dict[str, Path] = {}       # tag -> root it was saved under (for marks)
        self._deferred: list[tuple] = []       # marks for checkpoints not committed yet
        self.resumed_tag: str | None = None    # what the last resume loaded
        self.on_resume = on_resume or (lambda guard, step: None)  # after every resume: (guard, step)
        self.key = auth.key_from(self.cfg)     # checkpoint.hmac_key_env's key: sign and require signatures
        self._newer_than = -1                  # a resume's floor: the step the framework loaded itself
        self.stable_snapshots: set[str] = set()  # the in-memory tier's stable ones, seen by this process
        self.unloadable: set[str] = set()  # rollback targets that failed to load in this process (trainguard.recovery.degrade)
        self._first_dropped = False            # the first step's checkpoint was removed (checkpoint.first_step)
        self.lr_history = lr_history           # trainguard.recovery.lrcut.LrHistory: when the run has grown past young
        beat_from_training_thread(heart)  # (hashing and verifying are progress: trainguard.checkpoint.fsio)
        self.pacer = SnapshotPacer(self.cfg.snapshot.every_steps, self.cfg.snapshot.max_overhead)
        self.snapshots = None                  # trainguard.checkpoint.memory_tier.MemoryTier (use_memory_tier)
        self.last_skipped: list[dict] = []     # what the last choice passed over, and why
        self.chosen_digest: str | None = None  # sha256 of the manifest rank 0 verified for the last choice
        self.saver = Saver(self)               # the commit protocol (sync and async) and the manifest
        # the directory as this process found it (rank 0), before anything here writes to it (the in-memory
        # tier writes the run marker at initialize): (it existed, it held the run marker)
        root = Path(self.cfg.dir) if self.cfg.dir else None
        self._found = (root.is_dir(), (root / RUN_ID).is_file()) if root is not None and rank() == 0 else None
        if self.key is not None and self._found and self._found[0] and os.stat(root).st_mode & 0o022:
            # (docs/checkpoints.md's threat model: who can rename in it can swap a folder in use)
            logging.getLogger("trainguard").warning("trainguard: checkpoint.dir %s is writable by other users (mode "
                                                    "%o): signed checkpoints need it writable by the job's user only "
                                                    "(chmod go-w)", root, os.stat(root).st_mode & 0o777)
        source = state.shard_source() if self.cfg.snapshot.every_steps else None
        if source is not None:  # (every rank together)
            from trainguard.checkpoint.memory_tier import MemoryTier

            self.snapshots = MemoryTier(self, source)

    def emit(self, step: int, record: Record, detail: dict, ranks=(), action=None) -> None:
        if self.guard is not None:
            self.guard.emit(step, record, ranks, action, detail)

    # ------------------------------------------------------------------ after every step
    def on_step_end(self, step: int, loss: float | None, anomaly: bool) -> None:
        """Stable marks, the post-save trajectory, the resume self-test (every rank)."""
        self.poll_pending()
        if self.resume_check is not None:
            result = self.resume_check.on_step(step, loss)
            if result is not None:
                self.emit(step, Record.RESUME_VERIFIED if result["ok"] else Record.RESUME_DISCONTINUITY, result)
                self.resume_check = None
        actions, self._deferred = self._deferred + self.health.on_step(step, loss, anomaly), []
        for action in actions:
            kind, tag, value = action
            if tag.startswith(MEMORY):  # a snapshot: marked in this process's memory, on every rank
                if kind == "stable":  # (the newest few: older ones have left node memory long since)
                    self.stable_snapshots = set(sorted(self.stable_snapshots | {tag}, key=snapshot_step)[-16:])
                continue
            root = self.roots.get(tag)
            if rank() != 0 or root is None:
                continue
            if not (root / tag).is_dir():
                if self.pending_tag() == tag:
                    self._deferred.append(action)  # still being written: mark it once committed
                continue
            name, mark = (TRAJECTORY, {"losses": {str(k): v for k, v in value.items()}}) if kind == "trajectory" \
                else (STABLE, {"stable_at_step": value, "stable_after": self.cfg.stable_after})
            try:
                why = write_mark(root / tag, name, mark, self.key)  # (signed, bound to its verified manifest)
            except (OSError, CheckpointError) as e:  # (a mark is advice: its failure never stops rank 0 alone)
                why = f"{root / tag}: the {name} mark could not be written: {e}"
            if why is not None:
                logging.getLogger("trainguard").warning("trainguard: %s", why)
            elif kind == "stable":
                self.emit(step, Record.CHECKPOINT_STABLE, {"tag": tag, "dir": str(root)})

    def _grown(self, step: int) -> bool:
        """Past the young horizon (the guard's LR history; FIRST_KEPT without a guard): the first step's checkpoint
        can go."""
        return self.lr_history.grown(step) if self.lr_history is not None else step >= FIRST_KEPT

    def after_step(self, step: int) -> None:
        """A periodic save when one is due, and the corrupt_checkpoint fault (tests, drills)."""
        c = self.cfg
        self.pacer.tick(time.perf_counter())  # (the step times a snapshot's cost shows in: max_overhead)
        saved = bool(c.dir and c.every_steps and step % c.every_steps == 0)
        if c.dir and c.every_steps and c.first_step and (step == 1 and not saved or self._grown(step)):
            if step == 1:  # (the save: insured; the drop at FIRST_KEPT is rank 0's alone, with no collective)
                self.insure(step, Path(c.dir) / FIRST, lambda: first.on_step(self, step))
            else:
                first.on_step(self, step)
        if saved and self.insure(step, Path(c.dir), lambda: self.save(c.dir)):
            self.pacer.disk_saved()
            if self.pacer.paced and self.pacer.due(step):
                self.pacer.stood_in(step)
        elif self.pacer.due(step):
            self.snapshot()  # (the in-memory tier: not where a disk checkpoint was just taken)
        faults = self.faults
        if faults is not None and c.dir and any(f.type == "corrupt_checkpoint" and f.active(step) for f in
                                                self.block.faults):
            self.wait_pending()  # every rank (a collective): the newest committed one, a save of this very step too
        if faults is not None and c.dir and faults.checkpoint_due(step):
            from trainguard.checkpoint.damage import corrupt_newest_checkpoint

            path = corrupt_newest_checkpoint(c.dir)
            self.guard.emit(step, Record.FAULT_INJECTED, [rank()], None, {
                "faults": [{"type": "corrupt_checkpoint", "step": step, "rank": rank()}], "file": path},
                rank_local=True)

    def insure(self, step: int, root: Path, save) -> bool:
        """Every rank: trainguard's own save (the insurance: periodic, the first step's) -- one that fails on any rank
        is a ``checkpoint_failed`` record and training goes on, never the run's death (a framework whose state cannot
        be written yet: megatron's distributed optimizer before its first update). Returns whether it committed."""
        errors = failures_of(save)
        if errors:  # (rank 0 writes the record: every rank's error in it)
            self.emit(step, Record.CHECKPOINT_FAILED, {"tag": step_tag(self.step_count()), "dir": str(root),
                                                       "sync": True, "errors": errors})
        return not errors

    # ------------------------------------------------------------------ the first step's (trainguard.checkpoint.first)
    def first_target(self) -> tuple[Path | None, str | None, str]:
        """The first step's checkpoint, verified, when it fits the run (every rank learns): (root, tag, why)."""
        return first.first_target(self)

    def refresh_first(self) -> None:
        """After a restart from the first step that changed the precision: the first step's checkpoint again."""
        first.refresh_first(self)

    def after_restart(self) -> None:
        """After a restart from the first step: a checkpoint of the run's new start at once."""
        first.after_restart(self)

    # ------------------------------------------------------------------ resume and load (.resume, .loading)
    def resume_on_start(self, newer_than: int = 0) -> Any:
        """With ``checkpoint.dir``: the resume at start, failing closed (trainguard.checkpoint.resume). ``newer_than``:
        the step the framework loaded itself (Megatron-LM's ``--load``). Returns what ``load`` returns."""
        return resume.resume_on_start(self, newer_than)

    def choose(self, root: Path, mode: str) -> tuple[str | None, list[dict], str | None]:
        """Rank 0: the newest checkpoint that verifies (and is stable, in 'stable' mode), what it passed over, and the
        digest of the manifest bytes it verified."""
        return resume.choose(self, root, mode)

    def choose_for_load(self, root: Path, tag: str | None, mode: str) -> tuple[str | None, list[dict]]:
        """Every rank: rank 0 verifies and everyone learns the choice (a named ``tag`` that fails raises)."""
        return resume.choose_for_load(self, root, tag, mode)

    def load(self, root, tag: str | None = None, mode: str = "latest_valid", purpose: str = "resume", **kwargs):
        """Every rank: ``tag`` (a disk tag, or ``memory:<tag>``), or the newest valid tier (trainguard.checkpoint.loading);
        ``purpose="rollback"``: the framework's state and RNG come back, the guard's statistics stay. Returns what the
        adapter's load returns, or the framework's nothing."""
        return loading.load(self, root, tag, mode, purpose, **kwargs)

    # ------------------------------------------------------------------ retention
    def retention(self, root: Path) -> None:
        """Rank 0, after a commit: ``keep_last`` and ``keep_stable`` (trainguard.checkpoint.retention.apply)."""
        apply_retention(root, self.cfg.keep_last, self.cfg.keep_stable, self.key)

    # ------------------------------------------------------------------ rollback (trainguard.checkpoint.rollback)
    def rollback_root(self) -> Path | None:
        if self.cfg.dir:
            return Path(self.cfg.dir)
        roots = list(self.roots.values())
        return roots[-1] if roots else None

    def rollback_target(self, root: Path, onset: int, mode: str, inclusive: bool = False) -> tuple[str | None, str, int]:
        """Rank 0 chooses on disk (trainguard.checkpoint.rollback.choose_rollback), every rank learns; then the
        newest valid tier: a snapshot in memory when one is newer than the disk's choice (in "stable" mode, one
        this process saw become stable: ``stable_after`` clean steps after it)."""
        return rollback.rollback_target(self, root, onset, mode, inclusive)

    def abandon_after(self, root: Path, step: int) -> list[str]:
        """After a rollback to ``step``: the abandoned trajectory's checkpoints are set aside (and its
        snapshots in memory dropped)."""
        return rollback.abandon_trajectory(self, root, step)


    # ------------------------------------------------------------------ the in-memory tier (every adapter)
    def snapshot(self) -> str | None:
        """This rank's shard to node memory, no collective; None when the tier is off on this rank."""
        tag = self.snapshots.take()
        if tag is not None:
            self.unloadable.discard(memory_tag(tag))  # (a new snapshot of that name: loadable until it fails itself)
            self.health.saved(memory_tag(tag), self.step_count())  # (stable marks: "stable" rollbacks)
        return tag

    def overhead(self, seconds: float) -> None:
        """Time a snapshot held the step up (goodput's overhead)."""
        if self.goodput is not None:
            self.goodput.overhead(seconds)

    # ------------------------------------------------------------------ saving (trainguard.checkpoint.saving)
    def save(self, root, tag: str | None = None, **kwargs) -> str:
        """Every rank: a checkpoint of the framework's state as ``root/tag`` (tag: the step's); ``kwargs`` go to the
        adapter's ``write``/``capture``/``sidecar`` (DeepSpeed's client_state, megatron's data_state)."""
        return self.saver.save(root, tag, **kwargs)

    def saved(self, root: Path, tag: str, step: int) -> None:
        """A save of ``tag`` committed (or, async, begun): its root known for marks, its health watched."""
        self.roots[tag] = root
        self.unloadable.discard(target_key(Path(root), tag))  # (a new checkpoint of that name: not the one that failed)
        self.health.saved(tag, step)


    # ------------------------------------------------------------------ the framework's step, what fits the run
    def step_count(self) -> int:
        return self.state.step()

    def not_before(self, root: Path) -> int:
        """Every rank: checkpoints older than this step do not fit the run any more (0: all fit) -- those of another
        precision, where the framework cannot load them (after a bf16 fallback); read by rank 0, learnt by all
        (trainguard.checkpoint.rollback.not_before)."""
        return rollback.not_before(self, root)

    def after_precision_change(self) -> None:
        """After the bf16 fallback (the driver calls it): snapshots of the old precision dropped where they would not
        load, and a checkpoint of the new precision at once, so that a restart comes back in bf16 rather than
        replaying the fp16 trouble."""
        if self.snapshots is not None and self.state.precision_bound():
            self.snapshots.wait()
            self.snapshots.store.drop_before(self.step_count())
        if self.cfg.dir:
            self.save(self.cfg.dir)

    @property
    def NOTHING(self) -> Any:  # noqa: N802 - what load returns when there was nothing to load (the framework's)
        return self.state.nothing

    def pending_tag(self) -> str | None:
        """The tag of a save still being written in the background, if any."""
        return self.saver.pending.tag()

    def poll_pending(self, wait: bool = False) -> None:
        """Every rank: commit or report a finished background save (and snapshot)."""
        if self.snapshots is not None:
            self.snapshots.poll(wait)
        self.saver.pending.poll(wait)

    def wait_pending(self) -> None:
        self.poll_pending(wait=True)

    def close(self) -> None:
        self.wait_pending()
        if self.snapshots is not None:
            self.snapshots.close()
