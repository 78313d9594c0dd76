"""Asynchronous checkpoint writing: copy to host memory now, write and commit in the background.

The blocking part is :func:`snapshot` (every tensor cloned to CPU). A :class:`BackgroundCommit`
per rank then writes its files into the staging directory, fsyncs and hashes them, and leaves a
marker ``.done.rank<r>.json`` listing them; rank 0's thread waits for every rank's marker, writes
the manifest, renames the directory into place and moves ``latest``. A rank whose write fails (a
full disk) leaves ``.failed.rank<r>.json`` with the error instead, so that rank 0 gives up at once
rather than wait out its timeout: the checkpoint stays invisible on every rank. No collective runs in the
background (a thread must not race the training loop's collectives): the ranks meet through the
filesystem. A crash at any moment leaves only staging behind, which no resume looks at.
"""
from __future__ import annotations

import copy
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from trainguard.checkpoint.fsio import atomic_write_json, save_hashed, sha256_file

MARKER = ".done.rank{}.json"
FAILED = ".failed.rank{}.json"


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


class BackgroundCommit:
    """One save's background work on one rank."""

    def __init__(self, staged: Path, rank: int, world: int, writes: list[tuple[Any, Path]],
                 json_writes: list[tuple[Any, Path]], finish: Callable[[dict], None] | None,
                 timeout_s: float = 1800.0, fail: BaseException | None = None):
        self.staged, self.rank, self.world = staged, rank, world
        self.writes, self.json_writes = writes, json_writes
        self.finish = finish           # rank 0: given every rank's file table, commit
        self.timeout_s = timeout_s
        self.fail = fail               # raised after the first file (the checkpoint_write_error fault)
        self.error: BaseException | None = None
        self.seconds = 0.0
        self.bytes = 0
        self._thread = threading.Thread(target=self._run, name=f"trainguard-ckpt-{rank}", daemon=True)
        self._stop = threading.Event()
        self._thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            table = {}
            for state, path in self.writes:
                path.parent.mkdir(parents=True, exist_ok=True)
                table[os.path.relpath(path, self.staged)] = save_hashed(state, path)  # hashed while written
                if self.fail is not None:
                    raise self.fail
            for data, path in self.json_writes:
                path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_json(path, data)
                digest, size = sha256_file(path)
                table[os.path.relpath(path, self.staged)] = {"sha256": digest, "size": size}
            self.bytes = sum(v["size"] for v in table.values())
            atomic_write_json(self.staged / MARKER.format(self.rank), table)
            self.writes = self.json_writes = []  # free the host copies
            if self.finish is not None:
                merged = self._gather_markers()
                if merged is not None:
                    self.finish(merged)
        except BaseException as e:  # noqa: BLE001 - reported by wait()
            self.error = e
            self.writes = self.json_writes = []
            try:  # (rank 0 stops waiting for this rank's files)
                atomic_write_json(self.staged / FAILED.format(self.rank), {"error": f"{type(e).__name__}: {e}"})
            except OSError:
                pass
        finally:
            self.seconds = time.perf_counter() - t0

    def _gather_markers(self) -> dict | None:
        deadline = time.monotonic() + self.timeout_s
        paths = [self.staged / MARKER.format(r) for r in range(self.world)]
        while not all(p.exists() for p in paths):
            failed = [r for r in range(self.world) if (self.staged / FAILED.format(r)).exists()]
            if failed:
                why = json.loads((self.staged / FAILED.format(failed[0])).read_text())["error"]
                raise OSError(f"rank {failed[0]} could not write its part of {self.staged}: {why}")
            if self._stop.is_set() or time.monotonic() > deadline:
                missing = [r for r, p in enumerate(paths) if not p.exists()]
                raise TimeoutError(f"ranks {missing} never finished writing {self.staged}")
            time.sleep(0.01)
        merged = {}
        for p in paths:
            merged.update(json.loads(p.read_text()))
            p.unlink()
        return merged

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        self._thread.join()
        if self.error is not None:
            raise self.error

    def cancel(self) -> None:
        self._stop.set()
