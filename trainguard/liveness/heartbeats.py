"""Heartbeats and what they say (trainguard.liveness.watchdog's parts, framework-free): each rank's :class:`Heartbeat` (the
step, the phase and the time of the last progress -- attribute writes on the training thread), the boards they are
published to (the rendezvous store, or a directory), and :func:`find_hung` -- from everyone's last beat, whether the
job is hung and which rank caused it (:class:`HangVerdict`).
"""
from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trainguard.ranks.attempt import restart_attempt
from trainguard.events import Phase


@dataclass
class Beat:
    rank: int
    host: str
    pid: int
    step: int
    phase: str
    progress: float      # wall time of the last phase change
    published: float     # wall time this record was written (the publisher's own liveness)
    attempt: int = 0     # the job's attempt that wrote it (trainguard.ranks.attempt: torchrun's restarts + requeues)
    started: int | None = None  # the process's start time (clock ticks since boot, /proc): who `pid` is

    @classmethod
    def parse(cls, text: str | bytes) -> "Beat":
        d = json.loads(text)
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d or k not in ("attempt", "started")})


def process_start(pid: int) -> int | None:
    """A process's start time (field 22 of /proc/<pid>/stat, clock ticks since boot): with the pid, it names one
    process -- a pid alone may have been reused by anyone's process since it was published. None off Linux."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


class Heartbeat:
    """What the training thread updates (cheap: attribute writes under the GIL)."""

    def __init__(self, rank: int):
        self.rank, self.host, self.pid = rank, socket.gethostname(), os.getpid()
        self.step, self.phase, self.progress = 0, "start", time.time()
        self.attempt = restart_attempt()
        self.started = process_start(self.pid)

    def beat(self, phase: Phase | str, step: int | None = None) -> None:
        self.phase = Phase(phase).value  # (a phase outside trainguard.events.Phase: ValueError, by name)
        if step is not None:
            self.step = step
        self.progress = time.time()

    def record(self) -> Beat:
        return Beat(self.rank, self.host, self.pid, self.step, self.phase, self.progress, time.time(), self.attempt,
                    self.started)


# ---------------------------------------------------------------------------------- boards
class StoreBoard:
    """Heartbeats in a c10d store (the rendezvous store), under ``prefix``."""

    def __init__(self, store, prefix: str, world: int):
        self.store, self.prefix, self.world = store, prefix, world

    def publish(self, beat: Beat) -> None:
        self.store.set(f"{self.prefix}/hb/{beat.rank}", json.dumps(asdict(beat)))

    def read(self) -> dict[int, Beat]:
        keys = [f"{self.prefix}/hb/{r}" for r in range(self.world)]
        present = [k for k in keys if self.store.check([k])]
        if not present:
            return {}
        return {b.rank: b for b in (Beat.parse(v) for v in self.store.multi_get(present))}


class DirBoard:
    """Heartbeats as one small JSON file per rank in a directory (shared across nodes, or one node)."""

    def __init__(self, path: str | os.PathLike, world: int):
        from trainguard.metrics.sharedfs import own_folder

        self.path, self.world = Path(path), world
        own_folder(self.path, "trainguard.distributed.watchdog.dir")  # (0700, the job's own: a forged beat stops every rank)

    def publish(self, beat: Beat) -> None:
        from trainguard.checkpoint.fsio import atomic_write_text  # (a random, exclusive temporary: no planted link)

        atomic_write_text(self.path / f"hb.rank{beat.rank}.json", json.dumps(asdict(beat)), durable=False)

    def read(self) -> dict[int, Beat]:
        from trainguard.metrics.sharedfs import read_own

        out = {}
        for r in range(self.world):
            text = read_own(self.path / f"hb.rank{r}.json")  # (a file of the job's user's own only)
            try:
                out[r] = Beat.parse(text) if text is not None else None
            except (ValueError, KeyError, TypeError):
                continue
            if out[r] is None:
                del out[r]
        return out


# ---------------------------------------------------------------------------------- decision
@dataclass
class HangVerdict:
    culprits: list[int]
    why: str
    beats: dict[int, Beat] = field(default_factory=dict)

    def describe(self) -> list[dict]:
        now = time.time()
        return [{"rank": r, "host": b.host, "pid": b.pid, "phase": b.phase, "step": b.step,
                 "no_progress_s": round(now - b.progress, 1), "silent_s": round(now - b.published, 1)}
                for r, b in sorted(self.beats.items()) if r in self.culprits]


def find_hung(beats: dict[int, Beat], world: int, now: float, hang_timeout_s: float,
              interval_s: float, attempt: int | None = None) -> HangVerdict | None:
    """Pure: from everyone's last heartbeat, is the job hung, and which rank(s) caused it?
    ``attempt``: only heartbeats of this restart attempt count (a rank that has not published in it
    yet is still starting, whatever the attempt before left on the board)."""
    if attempt is not None:
        beats = {r: b for r, b in beats.items() if b.attempt == attempt}
    if len(beats) < world:
        return None  # not everyone has started yet: startup is not a hang
    stalled = {r: b for r, b in beats.items() if now - b.progress > hang_timeout_s}
    if not stalled:
        return None
    silent = [r for r, b in stalled.items() if now - b.published > max(3 * interval_s, 2.0)]
    if silent:
        return HangVerdict(sorted(silent), "its heartbeat stopped: the process is stopped, dead or wedged "
                           "without the GIL", beats)
    if any(b.phase == "checkpoint" for r, b in beats.items() if r not in stalled):
        # (the others wait for a rank that hashes or verifies a checkpoint -- rank 0 verifies alone while the rest
        # wait in the broadcast of its choice: progress, not a hang; it stalls too when it is done or stuck)
        return None
    top = max(b.step for b in beats.values())
    behind = [r for r, b in stalled.items() if b.step < top]
    if behind:
        return HangVerdict(sorted(behind), f"behind the others (step < {top}) and not progressing", beats)
    outside = [r for r, b in stalled.items() if b.phase != "collective"]
    if outside and len(outside) < len(stalled):
        return HangVerdict(sorted(outside), "not progressing outside a collective while the others wait in one",
                           beats)
    return HangVerdict(sorted(stalled), "no rank progresses (a deadlock, or a hung collective)", beats)


def _same_process(b: Beat) -> bool:
    if b.started is None or process_start(b.pid) != b.started:
        return False
    try:
        return os.stat(f"/proc/{b.pid}").st_uid == os.geteuid()
    except OSError:
        return False


# ---------------------------------------------------------------------------------- the whole
def default_board(cfg, world: int):
    """The board ``distributed.watchdog`` asks for: files in ``dir``, or the default process
    group's store -- above any per-attempt prefix, so that an attempt sees the one before."""
    if cfg.board == "dir":
        return DirBoard(cfg.dir, world)
    try:
        import torch.distributed.distributed_c10d as c10d

        store = c10d._get_default_store()
    except Exception:  # noqa: BLE001 - private API: no store, no store board
        return None
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return StoreBoard(store.clone() if hasattr(store, "clone") else store, "trainguard/watchdog", world)
