"""Goodput: how much of the wall time went into training that survived.

    goodput = productive step time / wall time

*Wall time* runs from the first step's start to the last step's end (plus, across restarts, the
downtime between them: :meth:`GoodputMeter.downtime`). A step's time is the time since the
previous step ended (data, forward, backward, the guard, the optimizer). It is *productive* when
the step was applied and is still part of the final trajectory: a skipped step, a step undone by
a rollback (and the rollback itself), and the loop's time blocked on checkpoint saves are not.

Host clock only; one reading per step.
"""
from __future__ import annotations

import time
from typing import Callable


class GoodputMeter:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.start: float | None = None
        self.last: float | None = None
        self.kept: dict[int, float] = {}   # step -> productive seconds, for applied steps still in the trajectory
        self.executed = 0                   # optimizer steps computed, including those lost later
        self.skipped = 0
        self.rolled_back = 0                # applied steps undone by rollbacks
        self.overhead_s = 0.0               # checkpoint blocking inside steps
        self.down_s = 0.0                   # downtime between restarts
        self._pending_overhead = 0.0
        self._kept_s = 0.0                  # running sum of kept.values()

    def begin_step(self) -> None:
        """The first micro-batch of the run is about to be computed (later calls do nothing)."""
        if self.start is None:
            self.start = self.last = self.clock()

    def overhead(self, seconds: float) -> None:
        """Time inside the current step spent on something other than training (a checkpoint save)."""
        self._pending_overhead += seconds

    def step_done(self, step: int, applied: bool) -> None:
        now = self.clock()
        if self.start is None:
            self.start = self.last = now
        spent = max(0.0, now - self.last - self._pending_overhead)
        self.overhead_s += self._pending_overhead
        self._pending_overhead = 0.0
        self.last = now
        self.executed += 1
        self._kept_s -= self.kept.pop(step, 0.0)
        if applied:
            self.kept[step] = spent
            self._kept_s += spent
        else:
            self.skipped += 1

    def rollback(self, to_step: int) -> None:
        """Steps after ``to_step`` are undone: they no longer count as productive."""
        gone = [s for s in self.kept if s > to_step]
        for s in gone:
            self._kept_s -= self.kept.pop(s)
        self.rolled_back += len(gone)

    def downtime(self, seconds: float) -> None:
        """Time the job was down between a failure and this process's first step (a restart)."""
        self.down_s += max(0.0, seconds)

    def ratio(self) -> float | None:
        """The running goodput (for the metric line)."""
        wall = (self.last - self.start if self.start is not None else 0.0) + self.down_s
        return round(self._kept_s / wall, 4) if wall > 0 else None

    def summary(self) -> dict:
        wall = (self.last - self.start if self.start is not None and self.last is not None else 0.0) + self.down_s
        productive = sum(self.kept.values())
        return {"goodput": round(productive / wall, 4) if wall > 0 else None,
                "productive_s": round(productive, 3), "wall_s": round(wall, 3),
                "steps_executed": self.executed, "steps_kept": len(self.kept),
                "steps_lost": self.executed - len(self.kept), "skipped_steps": self.skipped,
                "rolled_back_steps": self.rolled_back, "checkpoint_blocking_s": round(self.overhead_s, 3),
                "downtime_s": round(self.down_s, 3)}
