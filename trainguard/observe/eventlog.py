"""The run's records: one closed vocabulary (:class:`trainguard.events.Record`), one way to write them.

Every record the suite writes -- the guard's verdicts, the driver's recoveries, the checkpoint
manager's saves and resumes, the watchdog's hangs -- goes through :meth:`EventLog.emit`, which
refuses anything that is not a ``Record`` member. Where a record goes:

- rank 0: the JSONL log (``metrics.jsonl``), the mirrors (TensorBoard, Prometheus), and the
  user's callbacks (``callbacks``: called on a background thread, never in the training step;
  a callback that raises is logged and the run goes on);
- every rank with ``metrics.per_rank``: its own ``<stem>.rank<r>.jsonl``, for the records that
  concern it (``rank_local``).

docs/events.md lists exactly the members of ``Record`` (a test checks both directions).
"""
from __future__ import annotations

import logging
import queue
import threading
from pathlib import Path
from typing import Any, Callable, Iterable

from trainguard.events import Record
from trainguard.metrics.jsonl import JsonlSink, clean
from trainguard.plugins import SINKS, Sink, build, resolve_callable

log = logging.getLogger("trainguard")


class _NamedOnce(logging.Filter):
    """Under logging a framework set up whose every handler prints the logger's name (Megatron-LM's ``basicConfig``:
    ``WARNING:trainguard:<message>``), a message's own leading "trainguard: " goes. Where a handler prints the message
    alone -- Python's last resort, a format without ``%(name)s`` -- it keeps its name."""

    def filter(self, record: logging.LogRecord) -> bool:
        handlers = logging.getLogger().handlers
        if isinstance(record.msg, str) and record.msg.startswith("trainguard: ") and handlers and all(
                "%(name)" in getattr(getattr(h, "formatter", None), "_fmt", "") for h in handlers):
            record.msg = record.msg[len("trainguard: "):]
        return True


log.addFilter(_NamedOnce())  # (every site logs through this one logger: logging.getLogger("trainguard"))


def per_rank_path(path: str, rank: int) -> str:
    p = Path(path)
    return str(p.with_name(f"{p.stem}.rank{rank}{p.suffix or '.jsonl'}"))


class _Callbacks:
    """The user's record subscribers, fed from a queue by one daemon thread (off the hot path)."""

    def __init__(self, functions: list[tuple[str, Callable]]):
        self.functions = functions
        self.failures = 0
        self._q: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="trainguard-callbacks", daemon=True)
        self._thread.start()

    def put(self, record: dict) -> None:
        self._q.put(record)

    def _run(self) -> None:
        while True:
            record = self._q.get()
            if record is None:
                return
            for name, fn in self.functions:
                try:
                    fn(record)
                except Exception as e:  # noqa: BLE001 - a user's callback never stops the run
                    self.failures += 1
                    log.warning("trainguard: callback %s failed on %s: %s: %s", name, record.get("event"),
                                type(e).__name__, e)

    def close(self, timeout: float = 10.0) -> None:
        self._q.put(None)
        self._thread.join(timeout)


class EventLog:
    """One rank's record writer. ``open`` after the coordinates are known; ``close`` at the end."""

    def __init__(self, rank: int):
        self.rank = rank
        self.log: JsonlSink | None = None        # rank 0's log
        self.rank_log: JsonlSink | None = None   # this rank's own (metrics.per_rank)
        self.mirrors: list = []                  # TensorBoard / Prometheus / W&B (rank 0)
        self.callbacks: _Callbacks | None = None
        self.jsonl: str | None = None
        self.started = False                     # this run's start is settled (a new run's or a resume's first step)

    def open(self, cfg) -> None:
        m = cfg.metrics
        self.jsonl = m.jsonl
        # every rank resolves the callbacks, so that a bad path stops every rank alike
        fns = [(spec, resolve_callable(spec, f"trainguard.callbacks[{i}]")) for i, spec in enumerate(cfg.callbacks)]
        if m.jsonl:
            if self.rank == 0:
                self.log = JsonlSink(m.jsonl)
            if m.per_rank:
                self.rank_log = JsonlSink(per_rank_path(m.jsonl, self.rank))
        if self.rank != 0:
            return
        if m.console:
            from trainguard.metrics.console import ConsoleSink

            self.mirrors.append(ConsoleSink(cfg))
        if m.tensorboard:
            from trainguard.metrics.tensorboard import TensorBoardSink

            self.mirrors.append(TensorBoardSink(m.tensorboard))
        if m.prometheus_port is not None:
            from trainguard.metrics.prometheus import PrometheusSink

            self.mirrors.append(PrometheusSink(m.prometheus_port, m.prometheus_addr))
        if m.wandb is not None:
            from trainguard.metrics.wandb import WandbSink

            self.mirrors.append(WandbSink(m.wandb, {"trainguard": cfg.model_dump(mode="json")}))
        for i, spec in enumerate(m.sinks):  # by "type": a registered name or your class
            self.mirrors.append(build(spec, SINKS, Sink, f"trainguard.metrics.sinks[{i}]"))
        if fns:
            self.callbacks = _Callbacks(fns)

    @property
    def writes(self) -> bool:
        """Whether this rank writes the run's log (rank 0 with ``metrics.jsonl``)."""
        return self.log is not None

    def emit(self, step: int, record: Record, ranks: Iterable[int] = (), action: str | None = None,
             detail: dict | None = None, rank_local: bool = False, to_run_log: bool = True,
             takeover: bool = False, **extra: Any) -> None:
        """Write one record. ``rank_local``: it concerns this rank, so its own log gets it too.
        ``to_run_log=False``: this rank's own log only. ``takeover``: written into the run's log
        even from a rank other than 0 (the watchdog, when rank 0 is the hung one)."""
        if not isinstance(record, Record):
            raise TypeError(f"trainguard records are members of trainguard.events.Record, not {record!r}")
        ranks = list(ranks)
        run_log = self.log if to_run_log else None
        borrowed = None
        if takeover and run_log is None and self.jsonl:
            run_log = borrowed = JsonlSink(self.jsonl)
        for sink in (run_log, self.rank_log if rank_local else None):
            if sink is not None:
                sink.event(step, record.value, ranks, action, detail, **extra)
        if borrowed is not None:
            borrowed.close()
        if self.rank != 0 or not to_run_log:
            return
        for m in self.mirrors:
            try:
                m.event(step, record.value, ranks, action, detail)
            except Exception as e:  # noqa: BLE001 - a mirror (the console, a dashboard) never stops rank 0 alone
                log.warning("trainguard: %s failed on %s: %s: %s", type(m).__name__, record.value, type(e).__name__, e)
        if self.callbacks is not None:
            self.callbacks.put(clean({"type": "event", "step": step, "event": record.value, "ranks": ranks,
                                      "action": action, "detail": detail or {}, **extra}))

    def metric(self, step: int, line: dict, rank_line: dict | None = None) -> None:
        if self.log is not None:
            self.log.metric(step, **line)
            for m in self.mirrors:
                m.metric(step, line)
        if self.rank_log is not None and rank_line is not None:
            self.rank_log.metric(step, **{**line, **rank_line})

    def first_step(self, step: int) -> None:
        """The first step this process trains (every rank, due or not): step 1 in the job's first attempt is a new run
        whoever decided the start -- no ``checkpoint.dir``, a trainer's own resume that found nothing --, so an earlier
        run's lines are set aside, said in a ``fresh_start``; a later first step is a resume (the log goes on)."""
        if self.started:
            return
        self.started = True
        from trainguard.ranks.attempt import generation, restart_attempt

        # (a world formed again after a rank was replaced is the same job, whatever its step)
        if step <= 1 and restart_attempt() == 0 and generation() == 0 and self.log is not None:
            earlier = self.new_run()
            if earlier:
                self.emit(step, Record.FRESH_START, [], None, {
                    "dir": None, "created": False, "attempt": 0, "set_aside": [], "earlier_log": earlier,
                    "reason": "a new run: its first step is step 1 (no trainguard checkpoint decided the start)"})

    def new_run(self) -> str | None:
        """A new run (a fresh start in its first attempt): an earlier run's lines in the log moved aside (rank 0;
        trainguard.metrics.jsonl.JsonlSink.set_prior_aside). Returns where they went."""
        self.started = True
        try:
            aside = self.log.set_prior_aside() if self.log is not None else None
        except OSError as e:  # (a log someone swapped meanwhile: this run appends as before, said)
            logging.getLogger("trainguard").warning("trainguard: the earlier run's log lines were not set aside: %s", e)
            return None
        return str(aside) if aside is not None else None

    def close(self) -> None:
        if self.callbacks is not None:
            self.callbacks.close()
            self.callbacks = None
        for sink in (self.log, self.rank_log, *self.mirrors):
            if sink is not None:
                sink.close()
        self.log = self.rank_log = None
        self.mirrors = []
