"""The commit protocol, for every adapter: how a checkpoint is saved, synchronously or in the background.

A staging folder agreed from rank 0 (created 0700, never through a planted link), the framework's files written by
the adapter (:class:`trainguard.protocols.State`, ``write`` or ``capture``) and hashed as they are produced, every
rank's sidecar (RNG, data position) and the guard's state hashed the same way, the tables gathered with a
collective, the manifest -- one schema for every framework: layout, lineage, health -- written last and signed,
the rename, retention. A crash leaves the old checkpoint or the new one, never half of one.
"""
from __future__ import annotations

import logging
import os
import subprocess
import time
import uuid
from pathlib import Path
from typing import Callable

import torch

from trainguard import __version__
from trainguard.checkpoint import hostroom, rng
from trainguard.checkpoint.async_writer import AsyncSave, BackgroundWrite, snapshot
from trainguard.checkpoint.commit import STAGING_HELD, as_written, commit_staged, leave_staging
from trainguard.checkpoint.fsio import save_hashed, write_json_hashed
from trainguard.checkpoint.layout import GUARD_STATE, SIDECAR, STAGING, CheckpointError, step_tag, validate_tag
from trainguard.checkpoint.manifest import Manifest
from trainguard.checkpoint.private import own_dir
from trainguard.config import config_hash
from trainguard.events import Record
from trainguard.ranks.isolation import all_true, barrier, broadcast_from_rank0, gather_objects, rank, world


def code_revision() -> str | None:
    """The git commit of the working directory the job runs from, if it is one (the manifest's lineage)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=os.getcwd())
        return (out.stdout.strip() or None) if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


class Saver:
    """``cp``: the checkpoint manager (its state port, config, guard, heartbeat, key, records, retention)."""

    def __init__(self, cp):
        self.cp = cp
        self.pending = AsyncSave(cp)
        self.revision = code_revision() if rank() == 0 else None
        self.said_room = False  # (an asynchronous save refused for memory: said once)
        self.losses: dict[int, float] = {}  # {step: its loss at save, the lower of the step's and the window median's}

    # ------------------------------------------------------------------ save
    def save(self, root: str | os.PathLike, tag: str | None = None, asynchronous: bool | None = None,
             local: bool = False, **kwargs) -> str:
        """Every rank: commit a checkpoint of the framework's state as ``root/tag`` (tag: the step's) or raise --
        asynchronous (``checkpoint.async``, or ``asynchronous``: the insurance's) with an adapter that can capture,
        the commit comes later (:meth:`AsyncSave.poll`). ``local``: where the adapter's own capture cannot (its
        framework's save is a collective), this rank's state as it is at this layout (``State.capture_local``: the
        first step's insurance, loaded only by this run's restart)."""
        cp = self.cp
        self.pending.poll(wait=True)  # a new save waits for the previous one
        state = cp.state
        if (cp.cfg.async_ if asynchronous is None else asynchronous) and self._room(state, local):
            cp.heart.beat("checkpoint")  # (the watchdog: the host copy of a large model is progress too)
            t0 = time.perf_counter()
            tag = validate_tag(tag if tag is not None else step_tag(state.step()))
            nonce, staging_root = self.staging(Path(root), tag)
            writes = state.capture(staging_root, tag, **kwargs)
            if writes is None and local and hasattr(state, "capture_local"):
                writes = state.capture_local(staging_root, tag)
            if writes is not None:
                return self._save_async(Path(root), tag, nonce, staging_root, writes, kwargs, t0)
            self._discard(staging_root)
        return self.save_staged(root, lambda staged, tag: state.write(staged, tag, **kwargs), tag=tag,
                                fmt=state.format, sidecar=lambda: self.sidecar(**kwargs))

    def _room(self, state, local: bool) -> bool:
        """Every rank: whether every node's memory can hold this save's host copies (trainguard.checkpoint.hostroom;
        the adapter's ``host_bytes(local)``: about what one rank copies, None where it copies nothing). Where one
        cannot, the save is written synchronously -- the framework's own way -- and the first such save says why."""
        size = getattr(state, "host_bytes", None)
        each = size(local) if size is not None else None
        if each is None:  # (the same on every rank: no host copies here, nothing to agree)
            return True
        why = hostroom.node_refusal(each, gather_objects)
        if all_true(why is None):
            return True
        if not self.said_room:
            self.said_room = True
            whys = [w for w in gather_objects(why) if w]
            if rank() == 0:
                logging.getLogger("trainguard").warning(
                    "trainguard: a checkpoint that would go to the background is saved synchronously instead: %s "
                    "(%d rank(s) said so). A smaller state a rank (ZeRO's stage, more data-parallel ranks) or more "
                    "memory for the job lets it go to the background again.", whys[0] if whys else "a node's memory",
                    len(whys))
        return False

    def staging(self, root: Path, tag: str) -> tuple[str, Path]:
        """Every rank: one staging name agreed from rank 0, its folder created there (0700, checked)."""
        outcome = None
        if rank() == 0:
            nonce = f"{tag}.{uuid.uuid4().hex[:10]}"
            try:
                if root.name.startswith("."):  # (one of trainguard's own folders in checkpoint.dir: .first)
                    root.parent.mkdir(parents=True, exist_ok=True)
                    own_dir(root)
                else:
                    root.mkdir(parents=True, exist_ok=True)
                    go_w(root, self.cp.key)
                with STAGING_HELD:  # (never between a commit's removal of an empty .staging: commit.leave_staging)
                    staging_root = own_dir(own_dir(root / STAGING) / nonce, fresh=True)
                own_dir(staging_root / tag, fresh=True)
                own_dir(staging_root / tag / SIDECAR, fresh=True)
                outcome = (nonce, None)
            except Exception as e:  # noqa: BLE001 - (never before the broadcast: the other ranks wait for it)
                outcome = (nonce, f"{type(e).__name__}: {e}")
        nonce, error = broadcast_from_rank0(outcome)
        if error:
            raise CheckpointError(f"trainguard: cannot stage a checkpoint in {root}: {error}")
        return nonce, root / STAGING / nonce

    def _discard(self, staging_root: Path) -> None:
        barrier()
        if rank() == 0:
            self._discard_now(staging_root)

    def save_staged(self, root: str | os.PathLike, write: Callable[[Path, str], dict], tag: str | None = None,
                    fmt: str | None = None, sidecar: Callable[[], dict] | None = None) -> str:
        """Every rank, synchronously: ``write(staged, tag)`` writes the framework's files under the staging folder and
        returns the table of those it hashed while writing them (rank 0 hashes the rest, read back: see
        docs/checkpoints.md's threat model); ``sidecar()``: this rank's own state, taken after ``write``."""
        cp = self.cp
        root = Path(root)
        cp.heart.beat("checkpoint")  # (the watchdog: progress, in a phase of its own)
        t0 = time.perf_counter()
        step = cp.step_count()
        tag = validate_tag(tag if tag is not None else step_tag(step))
        nonce, staging_root = self.staging(root, tag)
        staged = staging_root / tag
        barrier()
        try:
            own = dict(write(staged, tag))  # (the framework's save, with its own collectives)
        except BaseException:  # (a framework that cannot write its state yet: no staging folder left behind)
            if rank() == 0:
                self._discard_now(staging_root)
                leave_staging(root)
            raise
        faults = cp.faults
        if faults is not None and faults.dies_writing(step, "save"):  # (the kill_rank fault: a death mid-save)
            os.kill(os.getpid(), 9)
        mine = None
        try:  # trainguard's own files: a rank that cannot write them fails the save on every rank, named
            if sidecar is not None:
                own[f"{SIDECAR}/rank{rank()}.pt"] = save_hashed(sidecar(), staged / SIDECAR / f"rank{rank()}.pt")
            if rank() == 0 and cp.guard is not None:
                own[f"{SIDECAR}/{GUARD_STATE}"] = write_json_hashed(staged / SIDECAR / GUARD_STATE,
                                                                    cp.guard.state_dict())
        except Exception as e:  # noqa: BLE001
            mine = f"rank {rank()} could not write its part: {type(e).__name__}: {e}"
        hashed: dict = {}
        parts = gather_objects((mine, own))
        for _, part in parts:
            hashed.update(part)
        late: list[str] = []
        error = next((e for e, _ in parts if e), None)
        if rank() == 0 and error is None:
            try:
                error = as_written(staged, hashed, late)
                if error is None:
                    self.commit(root, tag, staging_root, nonce, step, hashed)
            except Exception as e:  # noqa: BLE001 - (never before the broadcast: the other ranks wait for it)
                error = f"{type(e).__name__}: {e}"
        error = broadcast_from_rank0(error)  # (every rank raises together: none waits for a commit that failed)
        if error is not None:
            if rank() == 0:
                self._discard_now(staging_root)
            raise CheckpointError(f"checkpoint {tag} in {root} was not committed: {error}")
        if rank() == 0:
            self.retain(root)
        self.note_loss(step)
        cp.saved(root, tag, step)
        seconds = time.perf_counter() - t0
        cp.overhead(seconds)
        cp.emit(step, Record.CHECKPOINT_SAVED, {
            "tag": tag, "dir": str(root), "files": len(hashed), "bytes": sum(f["size"] for f in hashed.values()),
            **({"format": fmt} if fmt else {}), "hashed_at_commit": late, "blocking_s": round(seconds, 3),
            "total_s": round(seconds, 3)})
        return tag

    @staticmethod
    def _discard_now(staging_root: Path) -> None:
        import shutil

        shutil.rmtree(staging_root, ignore_errors=True)

    def _save_async(self, root: Path, tag: str, nonce: str, staging_root: Path, writes: list, kwargs: dict,
                    t0: float) -> str:
        cp = self.cp
        staged = staging_root / tag
        writes = [(state, Path(path)) for state, path in writes]
        writes.append((snapshot(self.sidecar(**kwargs)), staged / SIDECAR / f"rank{rank()}.pt"))
        json_writes = [(cp.guard.state_dict(), staged / SIDECAR / GUARD_STATE)] if rank() == 0 and cp.guard else []
        step = cp.step_count()
        blocking = time.perf_counter() - t0
        cp.overhead(blocking)
        faults = cp.faults
        fail = faults.write_error(step) if faults is not None else None
        self.pending.start(BackgroundWrite(staged, writes, json_writes, fail=fail), {
            "tag": tag, "root": root, "staging_root": staging_root, "nonce": nonce, "step": step,
            "blocking_s": blocking, "t0": t0, "world": world(),
            "health": self.note_loss(step)})  # (the manifest's, as the save began)
        cp.saved(root, tag, step)
        return tag

    def commit(self, root: Path, tag: str, staging_root: Path, nonce: str, step: int, files: dict,
               health: dict | None = None) -> None:
        """Rank 0, once every file is written and hashed: the commit (retention follows: :meth:`retain`). ``health``:
        the guard's as the save began (an asynchronous one commits steps later; None: now)."""
        commit_staged(root, staging_root, nonce, self.manifest(tag, step, files, health=health), key=self.cp.key)

    def retain(self, root: Path) -> None:
        """Rank 0, after a commit every rank knows of: retention. Its failure loses no checkpoint (one too many is
        kept): logged, never a failed save."""
        try:
            self.cp.retention(root)
        except (OSError, CheckpointError) as e:  # (a StorageError: nothing deleted on it)
            import logging

            logging.getLogger("trainguard").warning("trainguard: retention in %s failed (%s: %s); the older "
                                                    "checkpoints stay", root, type(e).__name__, e)

    # ------------------------------------------------------------------ what a checkpoint says of itself
    def manifest(self, tag: str, step: int, files: dict, health: dict | None = None, **layout) -> Manifest:
        """One schema for every framework: the layout (the adapter's, and e.g. ``tier``), the lineage (data, config,
        releases, code) and the health at save time (``health``: the guard's then; None: now)."""
        cp, state = self.cp, self.cp.state
        health = health if health is not None else self.health()
        return Manifest(
            tag=tag, step=step, files=files,
            layout={"framework": state.name, **state.layout(), **layout},
            lineage={"dataset_id": cp.cfg.dataset_id, "dataset_version": cp.cfg.dataset_version,
                     "config_hash": config_hash(cp.block),
                     "versions": {"trainguard": __version__, "torch": torch.__version__, **state.versions()},
                     "code_revision": self.revision},
            health={"loss": health.get("loss"), "loss_median": health.get("loss_median"),
                    "loss_scale": health.get("loss_scale"), **state.health(),
                    "recent_anomalies": health.get("recent_anomalies", [])})

    def health(self) -> dict:
        """The guard's health now (a manifest's ``health``; empty without a guard)."""
        return self.cp.guard.health() if self.cp.guard is not None else {}

    def note_loss(self, step: int) -> dict:
        """Every rank, as a save of ``step`` begins (a manifest is rank 0's, and an asynchronous one is written steps
        later): the loss at ``step``, the lower of the step's and the window median's -- what a rollback to it gains
        (trainguard.recovery.room.keeps_progress). None known: the entry goes (a rollback to it is not refused).
        Returns the health it read (the manifest's, where the save writes one now)."""
        health = self.health()
        seen = [x for x in (health.get("loss"), health.get("loss_median")) if x is not None and x == x]
        self.losses.pop(step, None)
        if seen:
            self.losses[step] = min(seen)
        return health

    def sidecar(self, **kwargs) -> dict:
        """This rank's sidecar: who wrote it, every RNG, and the framework's part (data position, ...)."""
        return {"rank": rank(), "world": world(), "rng": rng.capture(), **self.cp.state.sidecar(**kwargs)}


def go_w(root: Path, key: bytes | None) -> None:
    """With a key, a save root others may write (HF's ``checkpoint-N``, made with the umask) is made go-w: who can
    rename inside it could swap a verified folder for an older signed one between a check and its use."""
    import logging
    import stat

    st = os.lstat(root)
    if key is not None and stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o022:
        os.chmod(root, stat.S_IMODE(st.st_mode) & ~0o022)
        logging.getLogger("trainguard").warning("trainguard: %s was writable by other users: made go-w (signed "
                                                "checkpoints need their folder the job's user's own)", root)
