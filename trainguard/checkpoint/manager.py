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

import fnmatch
import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from trainguard.attempt import restart_attempt
from trainguard.checkpoint import auth, rng
from trainguard.checkpoint.commit import restore_interrupted
from trainguard.checkpoint.fsio import atomic_write_json
from trainguard.checkpoint.health import CheckpointHealth, ResumeCheck
from trainguard.checkpoint.layout import GUARD_STATE, SIDECAR, STABLE, STAGING, TRAJECTORY, CheckpointError, CheckpointLayout
from trainguard.checkpoint.manifest import Manifest, VerifiedReader, manifest_digest, verify
from trainguard.checkpoint.pacing import SnapshotPacer
from trainguard.checkpoint.retention import to_delete
from trainguard.checkpoint.rollback import abandon_after, choose_rollback, fitting_after
from trainguard.checkpoint.saving import Saver
from trainguard.checkpoint.snapshots import MEMORY, RUN_ID, disk_tag, memory_tag, run_id, snapshot_step
from trainguard.checkpoint.verified_io import load_weights
from trainguard.data import merge_positions
from trainguard.events import Record
from trainguard.isolation import barrier, broadcast_from_rank0, rank, world
from trainguard.lrcut import YOUNG

FIRST = ".first"  # dir/.first: the first step's checkpoint (checkpoint.first_step)
FIRST_KEPT = 2 * YOUNG  # the first step's checkpoint is removed at this step

__all__ = ["CheckpointManager", "FIRST", "FIRST_KEPT", "barrier", "rank", "world"]


class CheckpointManager:
    """One per rank, over the adapter's :class:`trainguard.protocols.State` (``state``). ``cfg``: the whole block;
    ``guard``: the StepGuard (records, state, goodput); ``heart``: the rank's heartbeat (saves and loads count as
    progress)."""

    def __init__(self, cfg, guard, heart, state):
        self.state = state
        self.block = cfg
        self.cfg = cfg.checkpoint
        self.guard = guard
        self.heart = heart
        self.health = CheckpointHealth(self.cfg.stable_after, self.cfg.verify_steps)
        self.resume_check: ResumeCheck | None = None
        self.roots: dict[str, Path] = {}       # tag -> root it was saved under (for marks)
        self._deferred: list[tuple] = []       # marks for checkpoints not committed yet
        self.resumed_tag: str | None = None    # what the last resume loaded
        self.key = auth.key_from(self.cfg)     # checkpoint.hmac_key_env's key: sign and require signatures
        self._newer_than = -1                  # a resume's floor: the step the framework loaded itself
        self.stable_snapshots: set[str] = set()  # the in-memory tier's stable ones, seen by this process
        self._first_dropped = False            # the first step's checkpoint was removed (checkpoint.first_step)
        self._progress_from_training_thread()
        self.pacer = SnapshotPacer(self.cfg.snapshot.every_steps, self.cfg.snapshot.max_overhead)
        self.snapshots = None                  # trainguard.checkpoint.memory_tier.MemoryTier (use_memory_tier)
        self.last_skipped: list[dict] = []     # what the last choice passed over, and why
        self.chosen_digest: str | None = None  # sha256 of the manifest rank 0 verified for the last choice
        self.saver = Saver(self)               # the commit protocol (sync and async) and the manifest
        # the directory as this process found it (rank 0), before anything here writes to it (the in-memory
        # tier writes the run marker at initialize): (it existed, it held the run marker)
        root = Path(self.cfg.dir) if self.cfg.dir else None
        self._found = (root.is_dir(), (root / RUN_ID).is_file()) if root is not None and rank() == 0 else None
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
            if kind == "trajectory":
                atomic_write_json(root / tag / TRAJECTORY, {"losses": {str(k): v for k, v in value.items()}})
            elif kind == "stable":
                atomic_write_json(root / tag / STABLE, {"stable_at_step": value, "stable_after": self.cfg.stable_after})
                self.emit(step, Record.CHECKPOINT_STABLE, {"tag": tag, "dir": str(root)})

    def after_step(self, step: int) -> None:
        """A periodic save when one is due, and the corrupt_checkpoint fault (tests, drills)."""
        c = self.cfg
        self.pacer.tick(time.perf_counter())  # (the step times a snapshot's cost shows in: max_overhead)
        saved = bool(c.dir and c.every_steps and step % c.every_steps == 0)
        if c.dir and c.every_steps and c.first_step and (step == 1 and not saved or step >= FIRST_KEPT):
            self._first_step(step)
        if saved:
            self.save(c.dir)
            self.pacer.disk_saved()
            if self.pacer.paced and self.pacer.due(step):
                self.pacer.stood_in(step)
        elif self.pacer.due(step):
            self.snapshot()  # (the in-memory tier: not where a disk checkpoint was just taken)
        faults = self.guard.faults if self.guard is not None and self.block.faults else None
        if faults is not None and c.dir and faults.checkpoint_due(step):
            from trainguard.checkpoint.damage import corrupt_newest_checkpoint

            self.wait_pending()  # (the newest committed one: a save of this very step is committed first)
            path = corrupt_newest_checkpoint(c.dir)
            self.guard.emit(step, Record.FAULT_INJECTED, [rank()], None, {
                "faults": [{"type": "corrupt_checkpoint", "step": step, "rank": rank()}], "file": path},
                rank_local=True)

    def _progress_from_training_thread(self) -> None:
        """Hashing and verifying beat the heartbeat per chunk, in the phase the rank is in -- from the training
        thread only: a background writer's progress would hide a training thread that really hangs."""
        import threading

        from trainguard.checkpoint.fsio import on_progress

        heart, main = self.heart, threading.get_ident()
        if heart is None:
            return

        def beat() -> None:
            if threading.get_ident() == main:
                heart.beat(heart.phase)

        on_progress(beat)

    # ------------------------------------------------------------------ the first step's checkpoint
    def first_root(self) -> Path | None:
        return Path(self.cfg.dir) / FIRST if self.cfg.dir else None

    def _first_step(self, step: int) -> None:
        """After a fresh run's first step: a checkpoint apart from the periodic ones (checkpoint.first_step). At
        step FIRST_KEPT: removed (a restart from it is for a climb that began young, which is seen a little later)."""
        if step == 1:
            self._save_first()
        elif not self._first_dropped:  # (once per process: a run resumed past FIRST_KEPT drops it too)
            self._first_dropped = True
            self._drop_first()

    def _save_first(self) -> None:
        roots = dict(self.roots)
        tag = self.save(self.first_root())
        # (no stable mark or trajectory for it: a restart takes it as it is, and resume never sees it -- and the
        # main directory's checkpoint of the same tag, if any, keeps its own watch and root)
        mine = next((w for w in reversed(self.health.watching) if w.tag == tag), None)
        self.health.watching = [w for w in self.health.watching if w is not mine]
        if tag in roots:
            self.roots[tag] = roots[tag]
        else:
            self.roots.pop(tag, None)

    def _drop_first(self) -> None:
        root = self.first_root()
        if rank() == 0 and root.exists():
            trash = root.with_name(f"{FIRST}.deleted.{uuid.uuid4().hex[:6]}")
            root.rename(trash)  # (gone from its place at once; a crash leaves no half-deleted one there)
            shutil.rmtree(trash, ignore_errors=True)

    def after_restart(self) -> None:
        """After a restart from the first step: a checkpoint of the run's new start at once (the periodic ones were
        set aside with the abandoned trajectory; a crash before the next save would start the run afresh, its
        lowered LR and its one restart forgotten)."""
        if self.cfg.dir:
            self.save(self.cfg.dir)

    def refresh_first(self) -> None:
        """After a restart from the first step that changed the precision (fp16 -> bf16): the first step's checkpoint
        again, in the precision the run goes on in (the fp16 one would not load any more)."""
        if self.cfg.dir and self.cfg.first_step:
            self._drop_first()
            self._save_first()

    def first_target(self) -> tuple[Path | None, str | None, str]:
        """The first step's checkpoint, verified, when it fits the run (every rank learns)."""
        root = self.first_root()
        choice = None
        if rank() == 0:
            try:  # (rank 0 never raises before the broadcast: the others would wait for it)
                choice = (None, "no checkpoint of the first step", []) if root is None or not root.exists() else \
                    choose_rollback(root, 1, "latest_valid", self.not_before(root), inclusive=True, key=self.key)
            except OSError as e:
                choice = (None, f"the first step's checkpoint could not be listed: {e}", [])
        tag, why, bad = broadcast_from_rank0(choice)
        for b in bad:
            self.emit(self.step_count(), Record.CHECKPOINT_INVALID, b)
        return (root if tag is not None else None), tag, why

    # ------------------------------------------------------------------ retention
    def retention(self, root: Path) -> None:
        """Rank 0, after a commit: doomed checkpoints are renamed into staging (gone from the
        listing at once), then deleted -- a crash never leaves a half-deleted one that looks committed."""
        layout = CheckpointLayout(root)
        tags = layout.tags()
        stable = {t for t in tags if (layout.tag_dir(t) / STABLE).exists()}
        for t in to_delete(tags, stable, self.cfg.keep_last, self.cfg.keep_stable):
            trash = layout.root / STAGING / f"deleted.{t}.{uuid.uuid4().hex[:6]}"
            trash.parent.mkdir(parents=True, exist_ok=True)
            os.replace(layout.tag_dir(t), trash)
            shutil.rmtree(trash, ignore_errors=True)

    # ------------------------------------------------------------------ resume
    def choose(self, root: Path, mode: str) -> tuple[str | None, list[dict]]:
        """Rank 0: the newest checkpoint that verifies (and is stable, in 'stable' mode)."""
        layout = CheckpointLayout(root)
        steps = layout.steps()
        skipped = layout.passed_over()
        for tag, step in reversed(steps):
            if step <= self._newer_than:  # (older ones are older still)
                skipped.append({"tag": tag, "reason": f"not newer than step {self._newer_than}, which the "
                                f"framework loaded from its own checkpoint", "dir": str(root)})
                break
            res = verify(layout.tag_dir(tag), key=self.key)
            if res.io_error:  # (never passed over for a storage error: an older one loaded would set it aside)
                skipped.append({"tag": tag, "bad_file": res.bad_file, "reason": res.reason, "dir": str(root),
                                "io_error": True})
                return None, skipped
            if not res.ok:
                skipped.append({"tag": tag, "bad_file": res.bad_file, "reason": res.reason, "dir": str(root)})
                continue
            if mode == "stable" and not (layout.tag_dir(tag) / STABLE).exists():
                skipped.append({"tag": tag, "reason": "not stable", "dir": str(root)})
                continue
            return tag, skipped
        return None, skipped

    def choose_for_load(self, root: Path, tag: str | None, mode: str) -> tuple[str | None, list[dict]]:
        """Every rank: rank 0 verifies (``tag`` alone, or newest first) and everyone learns the
        choice; invalid ones passed over are reported. A named ``tag`` that fails raises."""
        decision = None
        if rank() == 0:
            if tag is not None:
                res = verify(CheckpointLayout(root).tag_dir(tag), key=self.key)
                decision = (tag if res.ok else None,
                            [] if res.ok else [{"tag": tag, "bad_file": res.bad_file, "reason": res.reason,
                                                "dir": str(root)}])
            else:
                decision = self.choose(root, mode)
            # the manifest rank 0 verified, pinned by its digest: every rank loads against that one
            decision = (*decision, manifest_digest(CheckpointLayout(root).tag_dir(decision[0])) if decision[0] else None)
        chosen, skipped, self.chosen_digest = broadcast_from_rank0(decision)
        self.last_skipped = skipped
        for s in skipped:
            if "bad_file" in s:
                self.emit(self.step_count(), Record.CHECKPOINT_INVALID, s)
        io = [s for s in skipped if s.get("io_error")]
        if io:  # every rank: the run stops naming the file, nothing loaded and nothing moved
            raise CheckpointError(f"checkpoint {io[0]['tag']} in {root}: {io[0]['bad_file']}: {io[0]['reason']}: the "
                                  "run stops rather than pass over it (an older checkpoint loaded would set the "
                                  "newest aside: a storage error must not roll progress back). Fix the storage "
                                  "and restart.")
        if chosen is None and tag is not None:
            bad = skipped[0]
            raise CheckpointError(f"checkpoint {tag} in {root} does not verify: {bad['bad_file']}: {bad['reason']}")
        return chosen, skipped

    def resume_on_start(self, newer_than: int = 0) -> Any:
        """With ``checkpoint.dir``: put back a checkpoint a crash left half-replaced, clear what a
        crash left in staging, then (unless ``resume`` is "none") load the newest checkpoint that
        verifies, or the newest stable one. Returns what ``load`` returns (None when nothing was loaded).

        It fails closed (issue 25): when the directory holds checkpoints and none loads, or when a
        restarted attempt finds a directory that is not its run's (no run marker: unmounted, emptied or
        mistyped), it stops with a CheckpointError naming each checkpoint and why it was refused --
        never a fresh start over the run's work, and nothing is moved when nothing was loaded. A fresh
        start over existing checkpoints is the explicit ``resume: "none"`` (they are set aside, kept).
        ``newer_than``: the step the run is at already (the framework loaded its own checkpoint, e.g.
        Megatron-LM's ``--load``): only a newer snapshot is loaded -- one state, never two -- and finding
        none is no failure. Checkpoints after the step the run goes on from belong to another trajectory:
        they are set aside (``.abandoned/``, never deleted), so that no later save replaces them under
        their tag and no later resume picks them."""
        c = self.cfg
        if not c.dir:
            return None
        root = Path(c.dir)
        state = None
        if rank() == 0:
            existed, marked = self._found  # (as found at construction: rank 0 with a dir always has it)
            restored = restore_interrupted(root) if root.is_dir() else []
            if (root / STAGING).is_dir():
                shutil.rmtree(root / STAGING, ignore_errors=True)  # never-committed saves
            state = (existed, marked, restored)
        existed, marked, restored = broadcast_from_rank0(state)
        if restored:
            self.emit(self.step_count(), Record.CHECKPOINT_INVALID, {
                "dir": str(root), "tag": ", ".join(restored), "bad_file": STAGING,
                "reason": "a crash while the tag was saved again left it aside in staging: put back"})
        attempt = restart_attempt()
        if c.resume == "none":  # a fresh start, by choice: what is there is kept, out of the way
            set_aside = self.abandon_after(root, -1)
            self._fresh_start(root, existed, attempt, "checkpoint.resume is \"none\"", set_aside)
            return None
        tags = broadcast_from_rank0(CheckpointLayout(root).tags() if rank() == 0 else None)
        if not tags and not c.snapshot.every_steps:  # (with the in-memory tier, a run killed before its
            result = None                            # first disk checkpoint comes back from memory)
        else:
            self._newer_than = newer_than if newer_than > 0 else -1
            self.last_skipped = []
            try:
                result = self.load(root, mode=c.resume)
            finally:
                self._newer_than = -1
        if self.resumed_tag is None and newer_than <= 0:
            if tags:
                raise CheckpointError(self._refusal(root, tags, self.last_skipped))
            if attempt and not marked:
                raise CheckpointError(
                    f"trainguard: this is restarted attempt {attempt} of the job, and checkpoint.dir {root} "
                    f"{'holds no checkpoint and no run marker (' + RUN_ID + ')' if existed else 'does not exist'}: "
                    "it is not the directory the first attempt wrote to (unmounted, emptied, or another path?). "
                    "Mount or correct it and restart; to start this job afresh, set checkpoint.resume to \"none\".")
            self._fresh_start(root, existed, attempt, "no checkpoint in the directory yet", [])
            return result
        refused = [x for x in self.last_skipped if x.get("bad_file")] if self.resumed_tag is None else []
        if refused:  # (newer than the framework's --load, and not one verifies: a rotated key, a damaged mount)
            raise CheckpointError(
                f"trainguard: the framework loaded its own checkpoint (step {newer_than}); of the newer ones in "
                f"{root}, none can be loaded -- refused, not set aside:\n" + self._refusal(
                    root, [x["tag"] for x in refused], self.last_skipped))
        set_aside = self.abandon_after(root, self.step_count())
        if set_aside and rank() == 0:
            import logging

            logging.getLogger("trainguard").warning(
                "trainguard: the run goes on from step %d; the checkpoints after it (%s) belong to another "
                "trajectory and were moved to %s", self.step_count(), ", ".join(set_aside), root / ".abandoned")
        if self.resumed_tag is None and tags:  # (the framework loaded its own, newer_than: nothing newer here)
            reason = f"no checkpoint newer than step {newer_than} (loaded by the framework) verifies" + \
                (" and is stable" if c.resume == "stable" else "")
            self.emit(self.step_count(), Record.RESUME_SKIPPED, {
                "dir": str(root), "mode": c.resume, "checkpoints": tags, "reason": reason,
                "starting_at_step": self.step_count(), "set_aside": set_aside})
        self._mark_run(root)
        return result

    def _fresh_start(self, root: Path, existed: bool, attempt: int, reason: str, set_aside: list[str]) -> None:
        """A run that starts from nothing says so, and marks the directory as its own (RUN_ID)."""
        self.emit(self.step_count(), Record.FRESH_START, {
            "dir": str(root), "created": not existed, "attempt": attempt, "reason": reason, "set_aside": set_aside})
        if rank() == 0:
            import logging

            logging.getLogger("trainguard").warning(
                "trainguard: a fresh start in %s (%s%s)", root, reason,
                "; the directory did not exist and is created" if not existed else "")
        self._mark_run(root)

    def _mark_run(self, root: Path) -> None:
        if rank() == 0:
            run_id(root)  # (written once: a restarted attempt that finds no marker is not in its run's dir)
        barrier()

    def _refusal(self, root: Path, tags: list[str], skipped: list[dict]) -> str:
        why = {s["tag"]: (f"{s['bad_file']}: " if s.get("bad_file") else "") + s["reason"] for s in skipped}
        lines = [f"  {t}: {why.get(t, 'not chosen')}" for t in reversed(tags)]
        hint = ("set checkpoint.resume to \"latest_valid\" to take the newest valid one" if self.cfg.resume == "stable"
                else "repair the cause (the key in checkpoint.hmac_key_env's variable, the mount, the files)")
        return (f"trainguard: checkpoint.dir {root} holds {len(tags)} checkpoint(s) and none can be loaded "
                f"(checkpoint.resume={self.cfg.resume!r}); nothing was moved or deleted:\n" + "\n".join(lines) +
                f"\nTo resume, {hint}; `trainguard ckpt verify {root}` shows each one. To start afresh instead "
                "(these are then set aside in .abandoned/, kept), set checkpoint.resume to \"none\".")

    def start_resume_check(self, tag: str, tag_dir: Path) -> None:
        traj = tag_dir / TRAJECTORY
        if self.cfg.verify_steps and traj.exists():
            losses = {int(k): v for k, v in json.loads(traj.read_text())["losses"].items()}
            self.resume_check = ResumeCheck(tag, losses, self.cfg.verify_rtol)

    # ------------------------------------------------------------------ rollback
    def rollback_root(self) -> Path | None:
        if self.cfg.dir:
            return Path(self.cfg.dir)
        roots = list(self.roots.values())
        return roots[-1] if roots else None

    def rollback_target(self, root: Path, onset: int, mode: str, inclusive: bool = False) -> tuple[str | None, str]:
        """Rank 0 chooses on disk (trainguard.checkpoint.rollback.choose_rollback), every rank learns; then the
        newest valid tier: a snapshot in memory when one is newer than the disk's choice (in "stable" mode, one
        this process saw become stable: ``stable_after`` clean steps after it)."""
        choice = choose_rollback(root, onset, mode, self.not_before(root), inclusive, key=self.key) \
            if rank() == 0 else None
        tag, why, bad = broadcast_from_rank0(choice)
        for b in bad:
            self.emit(self.step_count(), Record.CHECKPOINT_INVALID, b)
        if self.snapshots is None:
            return tag, why
        only = {disk_tag(t)[0] for t in self.stable_snapshots} if mode == "stable" else None
        found = self.snapshots.choose(lo=max(self.disk_step(root, tag) + 1, self.not_before(root)),
                                      hi=onset + (1 if inclusive else 0), only=only)
        if found is None:
            return tag, why
        return memory_tag(found[0]), f"newest {'stable ' if mode == 'stable' else ''}snapshot in memory before the onset"

    def abandon_after(self, root: Path, step: int) -> list[str]:
        """After a rollback to ``step``: the abandoned trajectory's checkpoints are set aside (and its
        snapshots in memory dropped)."""
        moved = abandon_after(root, step) if rank() == 0 else None
        self.health.watching = [w for w in self.health.watching if w.step <= step]
        self.stable_snapshots = {t for t in self.stable_snapshots if snapshot_step(t) <= step}
        self.pacer.rewind(step)
        if self.snapshots is not None:
            self.snapshots.wait()
            self.snapshots.store.drop_after(step)
        return broadcast_from_rank0(moved)

    @staticmethod
    def disk_step(root: Path, tag: str | None) -> int:
        return Manifest.read(root / tag).step if tag is not None else -1

    # ------------------------------------------------------------------ the in-memory tier (every adapter)
    def snapshot(self) -> str | None:
        """This rank's shard to node memory, no collective; None when the tier is off on this rank."""
        tag = self.snapshots.take()
        if tag is not None:
            self.health.saved(memory_tag(tag), self.step_count())  # (stable marks: "stable" rollbacks)
        return tag

    def overhead(self, seconds: float) -> None:
        """Time a snapshot held the step up (goodput's overhead)."""
        if self.guard is not None:
            self.guard.goodput.overhead(seconds)

    # ------------------------------------------------------------------ saving (trainguard.checkpoint.saving)
    def save(self, root, tag: str | None = None, **kwargs) -> str:
        """Every rank: a checkpoint of the framework's state as ``root/tag`` (tag: the step's); ``kwargs`` go to the
        adapter's ``write``/``capture``/``sidecar`` (DeepSpeed's client_state, megatron's data_state)."""
        return self.saver.save(root, tag, **kwargs)

    def saved(self, root: Path, tag: str, step: int) -> None:
        """A save of ``tag`` committed (or, async, begun): its root known for marks, its health watched."""
        self.roots[tag] = root
        self.health.saved(tag, step)

    def commit(self, root: Path, tag: str, staging_root: Path, nonce: str, step: int, files: dict) -> None:
        self.saver.commit(root, tag, staging_root, nonce, step, files)

    def resumed(self, root: Path, tag: str, step: int, detail: dict) -> None:
        """After a resume's load (not a rollback's): the resume self-test armed and the ``resume`` record."""
        self.roots[tag] = root
        self.resumed_tag = tag
        self.start_resume_check(tag, root / tag)
        self.emit(self.step_count(), Record.RESUME, ranks=list(range(world())), detail={
            "tag": tag, "dir": str(root), "step": step, "tier": "disk", **detail,
            "verify_steps": len(self.resume_check.expected) if self.resume_check else 0})

    # ------------------------------------------------------------------ the load (every adapter)
    def load(self, root, tag: str | None = None, mode: str = "latest_valid", purpose: str = "resume", **kwargs):
        """Every rank: load ``tag`` (a disk tag, or ``memory:<tag>`` from :meth:`rollback_target`), or the newest
        valid tier -- the newest checkpoint that verifies (and is stable, with ``mode="stable"``), unless a snapshot
        in node memory is newer. Each rank reads only bytes it checked against the manifest rank 0 verified
        (:class:`VerifiedReader`; the adapter routes its framework's reads through it). ``purpose="rollback"``
        (in-process): the framework's state and RNG come back, the guard's statistics and budgets stay as they are
        now -- the run moves on, it does not relive. Returns what the adapter's load returns, or ``NOTHING``."""
        root = Path(root)
        self.heart.beat("checkpoint")
        if tag is not None and disk_tag(tag)[1]:  # a rollback target in memory
            return self._load_memory(disk_tag(tag)[0], purpose, [], kwargs)
        chosen, skipped = self.choose_for_load(root, tag, mode)
        if tag is None and self.snapshots is not None and mode != "stable":  # the newest valid tier
            found = self.snapshots.choose(lo=max(self.disk_step(root, chosen) + 1, self._newer_than + 1,
                                                 self.not_before(root)))
            if found is not None:
                return self._load_memory(found[0], purpose, skipped, kwargs)
        if chosen is None:
            return self.NOTHING
        tag_dir = CheckpointLayout(root).tag_dir(chosen)
        reader = VerifiedReader(tag_dir, self.chosen_digest, self.key)
        man = Manifest.read(tag_dir)
        result, detail = self.load_disk(root, chosen, man, reader, purpose, **kwargs)
        self.roots[chosen] = root
        if purpose == "rollback":
            return result
        self._load_guard_state(reader, tag_dir)
        self.resumed(root, chosen, man.step, {"fell_back_past": skipped, **detail,
                                              "verified_on_load": len(reader.read_files), "lineage": man.lineage})
        return result

    def _load_memory(self, tag: str, purpose: str, skipped: list, kwargs: dict):
        """This rank's shard of snapshot ``tag`` from node memory (fetched first from the peer's copy where this
        node lost it), its bytes checked against its manifest (and signature) on this rank."""
        fetched = self.snapshots.fetch(tag)
        own = self.snapshots.store.own
        reader = VerifiedReader(own / tag, key=self.key)
        result, detail = self.load_shard(own, tag, reader, purpose, **kwargs)
        if purpose == "rollback":
            return result
        self._load_guard_state(reader, own / tag)
        self.resumed_tag = memory_tag(tag)
        self.emit(self.step_count(), Record.RESUME, ranks=list(range(world())), detail={
            "tag": memory_tag(tag), "dir": str(own), "step": self.step_count(), "tier": "memory",
            "from_peer_copy": fetched, "fell_back_past": skipped, "resharded": None, "verify_steps": 0, **detail,
            "verified_on_load": len(reader.read_files)})
        return result

    def _load_guard_state(self, reader: VerifiedReader, tag_dir: Path) -> None:
        """The guard's statistics, budgets and quarantine as saved (a resume, not a rollback)."""
        if self.guard is not None and f"{SIDECAR}/{GUARD_STATE}" in reader.files:
            self.guard.load_state_dict(json.loads(reader.read(tag_dir / SIDECAR / GUARD_STATE)))

    # ------------------------------------------------------------------ loading the framework's state
    def load_disk(self, root: Path, tag: str, man: Manifest, reader: VerifiedReader, purpose: str,
                  **kwargs) -> tuple[Any, dict]:
        """Every rank: the framework's state of ``root/tag`` (through its conversion where the adapter needs one:
        trainguard.checkpoint.conversion), then the sidecars; every byte read through a verified reader."""
        state = self.state
        converted = state.conversion(man)
        load_root, files = root, reader
        if converted:
            from trainguard.checkpoint.conversion import converted as conversion

            digest = self.chosen_digest or manifest_digest(root / tag) or "unverified"
            load_root, files = conversion(self, root, tag, man, digest, reader)
        result, detail = state.load(load_root, tag, man, files, purpose, converted=converted, **kwargs)
        now = state.layout()
        same = not converted and all(man.layout.get(k) == now.get(k) for k in ("world", "tp", "pp", "dp"))
        data, restored = self._restore_sidecars(reader, root / tag, same, purpose)
        if purpose != "rollback":
            result = state.use_data(data, result)
        resharded = None if same else {"from": man.layout, "to": now, "from_dp": man.layout.get("dp"),
                                       "to_dp": now.get("dp"),
                                       **({"conversion_files_verified": len(files.read_files)} if converted else {})}
        return result, {"rng_restored": restored, "resharded": resharded, **detail}

    def load_shard(self, own: Path, tag: str, reader: VerifiedReader, purpose: str, **kwargs) -> tuple[Any, dict]:
        """Every rank: this rank's shard ``own/tag`` of the in-memory tier, then its sidecar."""
        result, detail = self.state.load_shard(own, tag, reader, purpose, **kwargs)
        data, restored = self._restore_sidecars(reader, own / tag, True, purpose)
        if purpose != "rollback":
            result = self.state.use_data(data, result)
        return result, {"rng_restored": restored, **detail}

    def _restore_sidecars(self, reader: VerifiedReader, tag_dir: Path, same: bool, purpose: str) -> tuple[Any, bool]:
        """This rank's RNG and the framework's part of its sidecar, when the ranks are the ones that wrote them
        (``same``); returns (the data position, whether the RNG came back). Resharded, the ranks are new: RNG streams
        start afresh (documented) and the data position is the old ranks' common one, merged (trainguard.data)."""
        def side(rel: str) -> dict:
            return load_weights(reader, tag_dir / rel)

        mine = f"{SIDECAR}/rank{rank()}.pt"
        if same:
            if mine not in reader.files:
                return None, False
            st = side(mine)
            if st.get("world", world()) != world():
                return None, False
            rng.restore(st["rng"])
            self.state.restore_sidecar(st)
            return _data_of(st), True
        if purpose == "rollback":
            return None, False
        names = sorted((f for f in reader.files if fnmatch.fnmatch(f, f"{SIDECAR}/rank*.pt")),
                       key=lambda f: int(f[len(SIDECAR) + 5:-3]) if f[len(SIDECAR) + 5:-3].isdigit() else 1 << 30)
        return merge_positions([_data_of(side(f)) for f in names]), False

    def step_count(self) -> int:
        return self.state.step()

    def not_before(self, root: Path) -> int:
        """Checkpoints older than this step do not fit the run any more (0: all fit): those of another precision,
        where the framework cannot load them (after a bf16 fallback)."""
        if not self.state.precision_bound():
            return 0
        return fitting_after(root, "precision", self.state.layout().get("precision"))

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


def _data_of(side: dict) -> Any:
    """A sidecar's data position (``data``; megatron's older sidecars: ``data_state``)."""
    return side.get("data", side.get("data_state"))
