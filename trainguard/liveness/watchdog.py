"""Liveness: per-rank heartbeats, a monitor that names a hung rank, and what happens then.

Every rank keeps a :class:`Heartbeat` -- the step, the phase (``data``, ``forward``, ``backward``,
``collective``, ``checkpoint``) and the time of the last *progress* (a phase change). Setting it
is a few attribute writes on the training thread, no I/O. A background thread publishes it every
``interval_s`` to a board -- the rendezvous store (one key per rank) or a directory -- together
with its own publish time, and reads everyone else's.

A rank is *hung* when its last progress is older than ``hang_timeout_s``. Every rank waiting in a
collective for a hung peer stops progressing too, so :func:`find_hung` names the culprit by what
distinguishes it: its publisher went silent (the process is stopped or dead), else it is behind
in steps, else it is the one *not* waiting in a collective. Then the monitor (on every live rank) dumps its stacks
and asks hung local ranks for theirs (SIGUSR1), writes ``hang_detected``, kills the hung local ranks (a stopped
process holds the launcher for its SIGTERM grace) and exits with ``exit_code`` for the launcher's restart -- or,
under trainguard.supervise, has the hung ranks killed for spares and goes on (trainguard.liveness.hung). Heartbeats, their
boards and the verdict: trainguard.liveness.heartbeats.

Framework-free: the adapter supplies the board and says when phases change.
"""
from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from trainguard.ranks.attempt import restart_attempt
from trainguard.events import Phase, Record
from trainguard.metrics.sharedfs import tail_lines
from trainguard.liveness.heartbeats import (  # noqa: F401 - (Beat, DirBoard, process_start: this module's names before)
    Beat, DirBoard, Heartbeat, HangVerdict, StoreBoard, _same_process, default_board, find_hung, process_start)
from trainguard.liveness.hung import replacing_hung
from trainguard.metrics.sharedfs import open_append, open_log

PHASES = tuple(p.value for p in Phase)


# ---------------------------------------------------------------------------------- monitor
class Monitor(threading.Thread):
    """Publishes this rank's heartbeat and watches everyone's. On a hang: ``on_hang(verdict)``."""

    def __init__(self, heart: Heartbeat, board, world: int, interval_s: float, hang_timeout_s: float,
                 on_hang: Callable[[HangVerdict], None]):
        super().__init__(name=f"trainguard-watchdog-{heart.rank}", daemon=True)
        self.heart, self.board, self.world = heart, board, world
        self.interval_s, self.hang_timeout_s, self.on_hang = interval_s, hang_timeout_s, on_hang
        self._halt = threading.Event()  # (not _stop: threading.Thread has a method of that name)
        self.io_since: float | None = None  # monotonic time the current board publish/read began
        self.on_stall: Callable[[float], None] | None = None
        self.errors = 0             # publish/read failures, in all
        self.failing = 0            # ... in a row (while > 0, hangs go undetected)
        self.last_error: str | None = None

    def run(self) -> None:
        threading.Thread(target=self._watch_own_io, name=f"{self.name}-io", daemon=True).start()
        while not self._halt.wait(self.interval_s):
            self.io_since = time.monotonic()  # (board I/O in progress: a hung filesystem stops it here)
            try:
                self.board.publish(self.heart.record())
                verdict = find_hung(self.board.read(), self.world, time.time(), self.hang_timeout_s,
                                    self.interval_s, attempt=self.heart.attempt)
            except Exception as e:  # noqa: BLE001 - a board hiccup must never kill training ...
                self.errors += 1
                self.failing += 1
                self.last_error = f"{type(e).__name__}: {e}"
                if self.failing in (1, 10) or self.failing % 100 == 0:  # ... nor go unnoticed
                    import logging

                    logging.getLogger("trainguard").warning(
                        "trainguard watchdog on rank %d: the heartbeat board failed %d time(s) in a row (%s); "
                        "hangs go undetected while it fails", self.heart.rank, self.failing, self.last_error)
                continue
            finally:
                self.io_since = None
            self.failing = 0
            if verdict is not None and not self._halt.is_set():
                self.on_hang(verdict)
                return

    def _watch_own_io(self) -> None:
        """The monitor's board I/O blocked past the hang timeout (a hung filesystem under a ``dir`` board, a stalled
        store): detection is blind, and a hung filesystem causes hangs -- ``on_stall`` (exit for a restart)."""
        while not self._halt.wait(min(self.interval_s, 1.0)):
            since = self.io_since
            if since is not None and time.monotonic() - since > self.hang_timeout_s:
                if self.on_stall is not None and not self._halt.is_set():
                    self.on_stall(time.monotonic() - since)
                return

    def stop(self) -> None:
        self._halt.set()


def install_stack_dump_signal(path: str | os.PathLike | None):
    """SIGUSR1 makes this process write every thread's Python stack (to ``path`` or stderr). The
    file is opened now (a hung main thread runs no Python: faulthandler writes from C); returns it."""
    if not hasattr(signal, "SIGUSR1"):
        return None
    try:  # (a file planted where the folder goes: the stacks go to stderr -- a log is never a stop)
        target = (Path(path).parent.mkdir(parents=True, exist_ok=True), open_log(path)[0])[1] if path else sys.stderr
    except OSError:
        path, target = None, sys.stderr
    faulthandler.register(signal.SIGUSR1, file=target, all_threads=True, chain=False)
    return target if path else None


def dump_own_stacks(path: str | os.PathLike) -> None:
    with open_append(path) as f:
        print(f"--- rank stacks at {time.strftime('%Y-%m-%d %H:%M:%S')} (pid {os.getpid()}) ---", file=f, flush=True)
        faulthandler.dump_traceback(file=f, all_threads=True)


HANG_MARKER = "TRAINGUARD_HANG_MARKER"
EXIT_DEADLINE_S = 15.0  # after a hang is found: the record, stacks and marker get this long, then the exit anyway


def arm_exit_deadline(code: int, after_s: float | None = None) -> threading.Timer:
    """Before any I/O on the way out: a timer that leaves the process with ``code`` after ``after_s``, whatever the I/O
    does meanwhile (a hung filesystem blocks the record, the stacks and the marker; a rank that never exits is never
    restarted). No I/O of its own."""
    timer = threading.Timer(EXIT_DEADLINE_S if after_s is None else after_s, os._exit, args=(code,))
    timer.daemon = True
    timer.start()
    return timer


def exit_for_restart(code: int, detail: dict | None = None) -> None:
    """Leave with ``code`` (distributed.watchdog.exit_code) after a hang. torchrun reports it as its own exit 1: when
    the environment names a marker file (TRAINGUARD_HANG_MARKER, the sbatch scripts'), it is written first."""
    marker = os.environ.get(HANG_MARKER)
    if marker:
        try:
            if os.lstat(Path(marker).parent).st_uid != os.geteuid():  # (the sbatch's 0700 folder: never made here)
                raise OSError(marker)
            with open_append(marker, mode=0o600) as f:  # (the job script acts on it only when the job's own)
                f.write(json.dumps({"time": time.time(), "exit_code": code, "pid": os.getpid(), **(detail or {})})
                        + "\n")
        except OSError:
            pass  # (the exit matters more than the marker)
    os._exit(code)  # (the JSONL sinks flush every line)


def signal_local(verdict: HangVerdict, host: str, sig: int) -> list[int]:
    """Send ``sig`` to the culprit ranks that run on this host; returns their pids. The heartbeat board is not
    authenticated and pids are reused: a process is signalled only when it is still the one that published
    the beat (same start time, same user) -- never whatever process holds that pid now."""
    sent = []
    for r in verdict.culprits:
        b = verdict.beats.get(r)
        if b is not None and b.host == host and b.pid != os.getpid() and _same_process(b):
            try:
                os.kill(b.pid, sig)
                sent.append(b.pid)
            except OSError:
                pass
    return sent


def last_logged_time(path) -> float | None:
    """The time of the last line of a JSONL log (what a restarted rank 0 knows of the attempt before)."""
    try:
        lines = tail_lines(path, 65536)
        return float(json.loads(lines[-1])["time"]) if lines else None
    except Exception:  # noqa: BLE001 - (any line a writer of the log folder appended: no time, never a raise)
        return None


class Watchdog:
    """Heartbeats, hang detection and restart bookkeeping for one rank, on top of a StepGuard.
    Both adapters use it; ``step_fn`` gives the framework's step count."""

    def __init__(self, cfg, guard, heart: Heartbeat, rank: int, world: int, step_fn: Callable[[], int], goodput):
        self.cfg, self.guard, self.heart = cfg, guard, heart   # cfg: the whole TrainguardConfig
        self.goodput = goodput  # trainguard.observe.goodput.GoodputMeter: a restart's downtime and lost steps
        self.rank, self.world, self.step_fn = rank, world, step_fn
        self.monitor: Monitor | None = None
        self._stacks = None  # the file SIGUSR1 dumps into (removed at stop when nothing was written)

    def stacks_dir(self) -> Path:
        w = self.cfg.distributed.watchdog
        if w.stacks_dir:
            return Path(w.stacks_dir)
        return Path(self.cfg.metrics.jsonl).parent if self.cfg.metrics.jsonl else Path.cwd()

    def start(self) -> None:
        """Start the monitor; on a restarted attempt (trainguard.ranks.attempt: a torchrun restart or a requeue) first write
        ``restart`` with the downtime since the previous attempt's last heartbeat."""
        w = self.cfg.distributed.watchdog
        if not w.enabled or self.monitor is not None:
            return
        board = default_board(w, self.world)
        if board is None:
            return
        self._stacks = install_stack_dump_signal(self.stacks_dir() / f"stacks.rank{self.rank}.txt")
        attempt = restart_attempt()
        # the last heartbeats of the attempt before, if any; every rank reads them before any rank of this
        # attempt publishes over its own (one barrier, at start only: a fast rank 1 used to replace its
        # previous beat before rank 0 had read it, and the restart record lacked it)
        previous = {r: b for r, b in board.read().items() if b.attempt != self.heart.attempt}
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        step = self.step_fn()
        if attempt > 0:
            last_alive = max((b.published for b in previous.values()), default=None)
            if last_alive is None and self.rank == 0 and self.cfg.metrics.jsonl:
                last_alive = last_logged_time(self.cfg.metrics.jsonl)
            down = time.time() - last_alive if last_alive is not None else None
            if down is not None and self.goodput is not None:
                self.goodput.downtime(down)
            if previous and self.goodput is not None:  # the failed attempt's steps after the checkpoint are lost
                self.goodput.lost_in_restart(max(b.step for b in previous.values()) - step)
            self.guard.emit(step, Record.RESTART, list(range(self.world)), None, {
                "attempt": attempt, "downtime_s": round(down, 3) if down is not None else None,
                "resumed_at_step": step, "world": self.world,
                "previous": {str(r): {"host": b.host, "phase": b.phase, "step": b.step}
                             for r, b in sorted(previous.items())}})
        self.heart.beat("data", step)
        board.publish(self.heart.record())
        self.monitor = Monitor(self.heart, board, self.world, w.interval_s, w.hang_timeout_s, self.on_hang)
        self.monitor.on_stall = self.on_stall
        self.monitor.start()

    def on_stall(self, seconds: float) -> None:
        """The board's I/O blocked for ``seconds`` (> hang_timeout_s): nobody's hang can be seen. Exit for a
        restart like a hang, the deadline armed before any I/O (the record may block on the same filesystem)."""
        w = self.cfg.distributed.watchdog
        arm_exit_deadline(w.exit_code)
        why = (f"the heartbeat board's I/O on rank {self.rank} blocked for {seconds:.0f} s (> hang_timeout_s "
               f"{w.hang_timeout_s:g}): a hung filesystem or store; hang detection is blind")
        try:
            sys.stderr.write(f"trainguard watchdog: {why}; exiting {w.exit_code} for a restart\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001
            pass
        me = [{"rank": self.rank, "host": self.heart.host, "pid": os.getpid(), "step": self.heart.step,
               "phase": "board_io"}]
        self.guard.emit(self.heart.step, Record.HANG_DETECTED, [self.rank], "restart", {
            "culprits": [dict(c, coords=self.guard.coords_of(self.rank)) for c in me], "why": why,
            "hang_timeout_s": w.hang_timeout_s, "detected_by": self.rank, "exit_code": w.exit_code},
            rank_local=True)
        exit_for_restart(w.exit_code, {"step": self.heart.step, "culprits": [self.rank], "why": why,
                                       "rank": self.rank, "host": self.heart.host})

    def on_hang(self, verdict: HangVerdict) -> None:
        """On the monitor thread of every live rank: stacks, the record, then exit for a restart -- under a
        deadline armed before any of that I/O (arm_exit_deadline)."""
        w, stacks = self.cfg.distributed.watchdog, self.stacks_dir()
        if self.rank in verdict.culprits and len(verdict.culprits) < self.world:
            return  # a culprit that can still think leaves the decision to the others
        if replacing_hung(self, verdict, lambda: signal_local(verdict, self.heart.host, signal.SIGKILL)):
            return  # (trainguard.supervise: spares take the hung ranks' places, nobody exits)
        arm_exit_deadline(w.exit_code)
        culprits = [dict(c, coords=self.guard.coords_of(c["rank"])) for c in verdict.describe()]
        detail = {"culprits": culprits, "why": verdict.why, "hang_timeout_s": w.hang_timeout_s,
                  "detected_by": self.rank, "stacks": str(stacks), "exit_code": w.exit_code, "advice": "the launcher "
                  "restarts the job (torchrun --max-restarts); it resumes from the newest valid checkpoint"}
        live = [r for r in range(self.world) if r not in verdict.culprits]
        # the lowest live rank writes the run's log (taking it over when rank 0 is the hung one)
        first = bool(live) and self.rank == live[0]
        # named first, then the stacks (the record says where they go; a hung rank needs a moment to write its own);
        # a link or folder planted where they go never costs the marker below (the requeue): the log is not the exit
        with contextlib.suppress(OSError, ValueError):
            self.guard.emit(self.heart.step, Record.HANG_DETECTED, verdict.culprits, "restart", detail,
                            rank_local=True, to_run_log=first, takeover=first)
            dump_own_stacks(stacks / f"stacks.rank{self.rank}.txt")
        asked = signal_local(verdict, self.heart.host, signal.SIGUSR1) if hasattr(signal, "SIGUSR1") else []
        if asked:
            time.sleep(1.0)  # a hung (not stopped) rank writes its stacks meanwhile
        if w.kill_hung_local:
            signal_local(verdict, self.heart.host, signal.SIGKILL)
        exit_for_restart(w.exit_code, {"step": self.heart.step, "culprits": verdict.culprits, "why": verdict.why,
                                       "rank": self.rank, "host": self.heart.host})

    def stop(self) -> dict:
        """Stop watching; an empty stacks file removed (a healthy run leaves none). Returns run_end's watchdog part."""
        if self.monitor is not None:
            self.monitor.stop()
        if self._stacks is not None:
            if hasattr(signal, "SIGUSR1"):
                faulthandler.unregister(signal.SIGUSR1)
            path = Path(self._stacks.name)
            self._stacks.close()
            self._stacks = None
            try:
                if path.stat().st_size == 0:
                    path.unlink()
            except OSError:
                pass
        m = self.monitor
        return {"board_errors": m.errors, "last_error": m.last_error} if m is not None else {}
