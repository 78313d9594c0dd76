"""The JSONL log: one JSON object per line, flushed per line so a crash keeps what happened.

Every line has ``type`` ("event" or "metric"), ``time`` (Unix seconds) and ``step``.
Event lines add ``event``, ``ranks``, ``action``, ``detail``; metric lines add ``loss``,
``grad_norm``, ``lr``, ``loss_scale``, ``skipped_steps``. NaN and Inf are written as ``null``
(strict JSON; the accompanying event says what was non-finite). Field reference: docs/events.md.
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from trainguard.metrics.sharedfs import open_append, open_log


def clean(value: Any) -> Any:
    """Make a value strict-JSON: non-finite floats -> None, tuples -> lists, tensors -> numbers."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    if hasattr(value, "item") and callable(value.item) and getattr(value, "numel", lambda: 0)() == 1:
        return clean(value.item())
    if hasattr(value, "value") and isinstance(getattr(value, "value"), str):  # str enums
        return value.value
    return value


_OPENED: set[str] = set()  # the logs this process opened: one opened again is the same run entered again (a spare)


class JsonlSink:
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if self.path.parent and not self.path.parent.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f, path = open_log(self.path)  # (never through a link planted in a shared log folder; never a stop)
        self.path = Path(path)
        self.prior = os.fstat(self._f.fileno()).st_size  # what an earlier process wrote: a restart's, or another run's
        if str(self.path.resolve()) in _OPENED:  # (written by this process before: this run's own, never set aside)
            self.prior = 0
        _OPENED.add(str(self.path.resolve()))

    def set_prior_aside(self) -> Path | None:
        """This file began with an earlier run's lines (``prior`` bytes, a new run in the same folder): move them to a
        file of their own beside it (``<name>.before-<time>.jsonl``) and keep only this run's here, so that a run never
        appends to another's log. Returns where they went (None: there were none)."""
        if not self.prior:
            return None
        self._f.flush()
        fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            here, ours = os.fstat(fd), os.fstat(self._f.fileno())
            if (here.st_dev, here.st_ino) != (ours.st_dev, ours.st_ino):  # (swapped since it was opened: not ours)
                raise OSError(f"{self.path} is no longer the log this process opened: left as it is")
            f.seek(self.prior)
            mine = f.read(64 << 20).decode("utf-8", "replace")  # (this run's first lines: a few, never a planted TB)
        aside = self.path.with_name(f"{self.path.stem}.before-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
                                    f"{self.path.suffix}")
        os.replace(self.path, aside)  # (the open file goes with it: cut back to the earlier run's lines below)
        os.ftruncate(self._f.fileno(), self.prior)
        self._f.close()
        try:
            self._f, self.prior = open_append(self.path), 0  # (anew: no-follow, a regular file)
        except OSError:  # (never a closed log: this run goes on after the earlier run's lines, as before; said above)
            self._f = open_append(aside)
            self._f.write(mine)
            self._f.flush()
            raise
        self._f.write(mine)
        self._f.flush()
        return aside

    def write(self, record: dict) -> None:
        record = {"time": round(time.time(), 3), **record}
        self._f.write(json.dumps(clean(record), separators=(",", ":")) + "\n")
        self._f.flush()

    def event(self, step: int, event: str, ranks, action: str | None, detail: dict | None = None, **extra):
        self.write({"type": "event", "step": step, "event": event, "ranks": list(ranks),
                    "action": action, "detail": detail or {}, **extra})

    def metric(self, step: int, **values) -> None:
        self.write({"type": "metric", "step": step, **values})

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


def read(path: str | os.PathLike) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
