"""When the in-memory tier takes its next snapshot: every ``every_steps`` steps, or -- with a cost budget
(``checkpoint.snapshot.max_overhead``) -- as often as that budget allows and never more often.

What a snapshot costs training is measured where it shows: in the step times. The blocking copy lands
in the step after it, and the background writer slows the steps it overlaps (it takes a core where the
cores are all busy, and the caches). So the pacer keeps every step's wall time; the snapshot's cost is
what the steps from it until its writer finished (one more step: its tail) took beyond the mean of the
recent steps no snapshot touched (the steps just after a disk checkpoint left out of both: that is the
disk's cost, not the tier's).
The interval to the next snapshot is then ``max(every_steps, ceil(cost / (budget * mean step)))``, the
cost smoothed over snapshots. Every rank must snapshot on the same steps (a snapshot every rank can load
carries one tag), so the adapter feeds :meth:`SnapshotPacer.taken` figures every rank agreed on (the
largest cost, the shortest step).
"""
from __future__ import annotations

import math
import statistics
from collections import deque

DISK_SHADOW = 4  # steps after a disk checkpoint whose excess is the disk's (its blocking part, its writer)
OTHERS = 200     # the recent steps the snapshots' are measured against


class SnapshotPacer:
    def __init__(self, every_steps: int, max_overhead: float | None = None, smoothing: float = 0.5):
        self.every = int(every_steps)
        self.budget = max_overhead
        self.smoothing = smoothing
        self.interval = self.every          # the steps until the next snapshot, once one was taken
        self.cost: float | None = None      # smoothed seconds a snapshot costs training
        self.next_step: int | None = None   # None: the first one, on a multiple of every_steps
        self._prev: float | None = None     # the time of the last tick
        self._tier: list[float] = []        # the last snapshot's steps (from it until its writer finished, + 1)
        self._others: deque[float] = deque(maxlen=OTHERS)  # the recent steps no snapshot or disk save touched
        self._shadow = 0                    # steps left that are a disk checkpoint's
        self._window = False                # the steps are the last snapshot's (its writer runs)
        self._closing = False               # its writer finished: one more step, then the window closes

    @property
    def paced(self) -> bool:
        return bool(self.every and self.budget)

    def due(self, step: int) -> bool:
        if not self.every:
            return False
        if not self.paced or self.next_step is None:
            return step % self.every == 0
        return step >= self.next_step

    # ------------------------------------------------------------------ measuring (paced only)
    def tick(self, now: float) -> None:
        """Every step, before its saves: the wall time since the last tick is that step's."""
        if not self.paced:
            return
        if self._prev is not None:
            if not self._shadow:
                (self._tier if self._window else self._others).append(now - self._prev)
            self._shadow = max(0, self._shadow - 1)
            if self._window and self._closing:
                self._window = self._closing = False
        self._prev = now

    def writer_done(self) -> None:
        """The last snapshot's background writer finished."""
        self._closing = True

    def disk_saved(self) -> None:
        """A disk checkpoint was taken at this step: the next steps' excess is its own."""
        self._shadow = DISK_SHADOW

    def figures(self) -> tuple[float, float] | None:
        """``(cost, mean step)`` in seconds of the last snapshot; None before one. With no step free of a
        snapshot yet (a writer that outlasts the interval), the window's whole time counts as its cost."""
        if not self._tier:
            return None
        if len(self._others) < 3:
            return sum(self._tier), min(self._tier)
        mean = statistics.fmean(self._others)
        return max(0.0, sum(self._tier) - len(self._tier) * mean), mean

    # ------------------------------------------------------------------ deciding
    def taken(self, step: int, cost_s: float | None = None, step_s: float | None = None) -> int:
        """A snapshot is taken at ``step``; ``cost_s``: what the previous one cost, ``step_s``: the mean step
        (both agreed by every rank; None for the first). Returns the interval to the next one."""
        if self.paced and cost_s is not None and step_s is not None and step_s > 0:
            self.cost = cost_s if self.cost is None else self.smoothing * cost_s + (1 - self.smoothing) * self.cost
            self.interval = max(self.every, math.ceil(self.cost / (self.budget * step_s)))
        self.next_step = step + self.interval
        self._tier, self._window, self._closing = [], True, False
        return self.interval

    def stood_in(self, step: int) -> None:
        """A disk checkpoint was taken where a snapshot was due: the next one an interval on."""
        self.next_step = step + self.interval
        self._tier, self._window, self._closing = [], False, False

    def rewind(self, step: int) -> None:
        """After a rollback to ``step``: the next snapshot one interval on from there (the rollback's own time
        is no snapshot's cost)."""
        if self.next_step is not None:
            self.next_step = min(self.next_step, step + self.interval)
        self._tier, self._prev, self._window, self._closing = [], None, False, False
