"""Asynchronous disk checkpoints (``checkpoint.async``), for every adapter: host copies now, written in the
background, committed by the training thread.

The blocking part is the adapter's capture (its framework's state dicts, every tensor cloned to host memory by
:func:`snapshot`) and trainguard's sidecars. A :class:`BackgroundWrite` per rank then writes those files into
the staging folder, each hashed from the bytes as they are produced and fsynced. The commit is
:meth:`AsyncSave.poll`'s, on the training thread, at a point every rank reaches together (the end of each step,
the next save, the run's end): once every rank's writer is done -- agreed with a collective -- the file tables
travel with a collective to rank 0, which commits (manifest, signature, rename) only when the staged folder
holds exactly the files the ranks wrote, at their sizes. No table ever passes through the shared folder, where
a writer of it could plant one; a crash at any moment leaves only staging, which no resume looks at.
"""
from __future__ import annotations

import copy
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch

from trainguard.checkpoint.fsio import save_hashed, write_json_hashed
from trainguard.checkpoint.layout import CheckpointError
from trainguard.events import Record
from trainguard.ranks.isolation import all_true, broadcast_from_rank0, distributed, gather_objects, rank

MAX_QUIET_FAILURES = 3  # background saves failed in a row before an error is logged (the newest good one ages)


def snapshot(obj: Any) -> Any:
    """A deep copy in which every tensor is a CPU clone (the blocking part of an async save)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps the mapping's type (OrderedDict, defaultdict, ...)
        for k in list(out.keys()):
            out[k] = snapshot(obj[k])
        return out
    if isinstance(obj, list):
        return [snapshot(v) for v in obj]
    if isinstance(obj, tuple):
        return type(obj)(*map(snapshot, obj)) if hasattr(obj, "_fields") else tuple(snapshot(v) for v in obj)
    return obj


class BackgroundWrite:
    """One save's files on one rank, written by a thread: ``writes`` [(state, path)] with torch.save,
    ``json_writes`` [(dict, path)] as JSON; ``table`` maps each path (relative to ``staged``) to its sha256 and
    size, hashed as written. ``fail``: raised after the first file (the checkpoint_write_error fault)."""

    def __init__(self, staged: Path, writes: list[tuple[Any, Path]], json_writes: list[tuple[Any, Path]],
                 fail: BaseException | None = None):
        self.staged, self.writes, self.json_writes, self.fail = staged, writes, json_writes, fail
        self.table: dict[str, dict] = {}
        self.error: BaseException | None = None
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._run, name="trainguard-ckpt-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            for state, path in self.writes:
                path.parent.mkdir(parents=True, exist_ok=True)
                self.table[os.path.relpath(path, self.staged)] = save_hashed(state, path)
                if self.fail is not None:
                    raise self.fail
            for data, path in self.json_writes:
                path.parent.mkdir(parents=True, exist_ok=True)
                self.table[os.path.relpath(path, self.staged)] = write_json_hashed(path, data)
        except BaseException as e:  # noqa: BLE001 - reported by AsyncSave.poll
            self.error = e
        finally:
            self.writes = self.json_writes = []  # free the host copies
            self.seconds = time.perf_counter() - t0

    @property
    def bytes(self) -> int:
        return sum(v["size"] for v in self.table.values())

    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self) -> None:
        self._thread.join()


class AsyncSave:
    """The one save in flight (``cp``: trainguard.checkpoint.manager.CheckpointManager, which starts it)."""

    def __init__(self, cp):
        self.cp = cp
        self.job: BackgroundWrite | None = None
        self.info: dict = {}
        self.failed_in_a_row = 0

    def start(self, job: BackgroundWrite, info: dict) -> None:
        """Every rank: ``info`` -- tag, root, staging_root, nonce, step, blocking_s, t0, world, health."""
        self.job, self.info = job, info

    def tag(self) -> str | None:
        return self.info["tag"] if self.job is not None else None

    def poll(self, wait: bool = False) -> None:
        """Every rank together: commit the save in flight once every rank's writer is done (``wait``: wait for this
        rank's first), or report why it failed -- on every rank."""
        job = self.job
        if job is None:
            return
        if wait:
            job.join()
        info = self.info
        if info["world"] > 1 and not distributed():  # (its ranks can no longer agree: never committed alone)
            self.job = None
            self._failed(info, "the process group was destroyed before this save was committed (destroy the engine, "
                         "or end the run, before destroy_process_group); its files stay in staging, which no resume "
                         "loads", keep=True)
            return
        if not all_true(job.done()):  # (one small all-reduce a step while a save is in flight)
            return
        self.job = None
        outcome = gather_objects((f"{type(job.error).__name__}: {job.error}" if job.error else None, job.table))
        failed = [(r, e) for r, (e, _) in enumerate(outcome) if e]
        error = f"rank {failed[0][0]} could not write its part: {failed[0][1]}" if failed else None
        if error is None and rank() == 0:
            try:
                self._commit(info, [t for _, t in outcome])
            except Exception as e:  # noqa: BLE001 - (never before the broadcast: the other ranks wait for it)
                error = f"{type(e).__name__}: {e}"
        error = broadcast_from_rank0(error)
        if error is not None:
            self._failed(info, error)
            return
        if rank() == 0:
            self.cp.saver.retain(info["root"])
        self.failed_in_a_row = 0
        self.cp.emit(info["step"], Record.CHECKPOINT_SAVED, {
            "tag": info["tag"], "dir": str(info["root"]), "bytes_this_rank": job.bytes, "async": True,
            "blocking_s": round(info["blocking_s"], 3), "write_s": round(job.seconds, 3),
            "total_s": round(time.perf_counter() - info["t0"], 3)})

    def _commit(self, info: dict, tables: list[dict]) -> None:
        """Rank 0: the staged folder must hold exactly what the ranks wrote, at the sizes they wrote (a file
        planted or swapped for one of another size is refused here; one of the same size fails its sha256 at
        every load, the signature binding the bytes as produced); then the commit and retention."""
        from trainguard.checkpoint.commit import as_written

        merged: dict = {}
        for t in tables:
            merged.update(t)
        why = as_written(Path(info["staging_root"]) / info["tag"], merged)
        if why is not None:
            raise CheckpointError(f"{why}; not committed")
        self.cp.saver.commit(info["root"], info["tag"], info["staging_root"], info["nonce"], info["step"], merged,
                             health=info.get("health"))

    def _failed(self, info: dict, error: str, keep: bool = False) -> None:
        """The checkpoint stays invisible (its staging removed); training goes on; after a few in a row, an error
        in the log: the newest committed checkpoint is getting older with every step."""
        import shutil

        self.failed_in_a_row += 1
        if rank() == 0 and not keep:
            shutil.rmtree(info["staging_root"], ignore_errors=True)
        self.cp.emit(info["step"], Record.CHECKPOINT_FAILED, {"tag": info["tag"], "dir": str(info["root"]),
                                                              "error": error, "failures_in_a_row": self.failed_in_a_row})
        if self.failed_in_a_row >= MAX_QUIET_FAILURES and rank() == 0:
            import logging

            logging.getLogger("trainguard").error(
                "trainguard: %d checkpoints in a row failed to save in the background (the last: %s); the newest "
                "committed checkpoint is getting older with every step -- check %s (space, quota, mount)",
                self.failed_in_a_row, error, info["root"])
