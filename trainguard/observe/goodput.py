"""Goodput: how much of the wall time went into training that survived.

    goodput = productive step time / wall time

*Wall time* runs from the first step's start to the last step's end; a restarted process resumes
the totals of the checkpoint it resumed from, and everything since that save -- the steps after
it, the failure, the downtime, the restart -- counts as wall time that produced nothing. A step's time is the time since the
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
        self.down_s = 0.0                   # of the wall time: downtime before this process (restarts)
        self._pending_overhead = 0.0
        self._kept_s = 0.0                  # running sum of kept.values()
        self.base_productive = 0.0          # carried over from the checkpoint a restarted run resumed from
        self.base_wall = 0.0
        self.base = {"executed": 0, "kept": 0, "skipped": 0, "rolled_back": 0}

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
        """Record the downtime before this process started (a restart). Reported, not added: the
        wall time resumed from the checkpoint already runs through it."""
        self.down_s += max(0.0, seconds)

    def _wall(self) -> float:
        return (self.last - self.start if self.start is not None and self.last is not None else 0.0) + \
            self.base_wall

    def ratio(self) -> float | None:
        """The running goodput (for the metric line)."""
        wall = self._wall()
        return round((self._kept_s + self.base_productive) / wall, 4) if wall > 0 else None

    def summary(self) -> dict:
        wall = self._wall()
        productive = sum(self.kept.values()) + self.base_productive
        b = self.base
        executed, kept = self.executed + b["executed"], len(self.kept) + b["kept"]
        return {"goodput": round(productive / wall, 4) if wall > 0 else None,
                "productive_s": round(productive, 3), "wall_s": round(wall, 3),
                "steps_executed": executed, "steps_kept": kept,
                "steps_lost": executed - kept, "skipped_steps": self.skipped + b["skipped"],
                "rolled_back_steps": self.rolled_back + b["rolled_back"], "checkpoint_blocking_s": round(self.overhead_s, 3),
                "downtime_s": round(self.down_s, 3)}

    def state_dict(self) -> dict:
        """For a checkpoint: the run's totals up to the save, with the wall time of the save."""
        s = self.summary()
        return {"productive_s": s["productive_s"], "wall_s": s["wall_s"], "saved_at": time.time(),
                "executed": s["steps_executed"], "kept": s["steps_kept"], "skipped": s["skipped_steps"],
                "rolled_back": s["rolled_back_steps"]}

    def load_state_dict(self, state: dict, now: float | None = None, ended: float | None = None) -> None:
        """A restarted process resumes the totals: everything since the save -- the steps after it,
        the failure, the restart -- is wall time that produced nothing. ``ended``: when a launch after the save
        ended cleanly (:func:`clean_end`) -- a relaunch of a finished run: the time until then counts, the idle time
        between the two launches does not (a user's trial read goodput 0.018 after a minute's pause)."""
        now = time.time() if now is None else now
        saved = float(state.get("saved_at", now))
        until = now if ended is None or ended < saved else min(now, ended)
        self.base_productive = float(state.get("productive_s", 0.0))
        self.base_wall = float(state.get("wall_s", 0.0)) + max(0.0, until - saved)
        self.base = {k: int(state.get(k, 0)) for k in self.base}

    def lost_in_restart(self, steps: int) -> None:
        """Steps the failed attempt computed after the checkpoint this process resumed from."""
        self.base["executed"] += max(0, steps)
        self.base["rolled_back"] += max(0, steps)


def clean_end(path) -> float | None:
    """When the last launch logged in the JSONL at ``path`` ended cleanly (its ``run_end`` with no ``interrupted``), or
    None (it was killed, stopped by an error, or there is no log): read from the log's tail, never a raise."""
    import json

    from trainguard.metrics.sharedfs import tail_lines

    try:
        for line in reversed(tail_lines(path, 1 << 20)):
            if b'"run_end"' in line:
                record = json.loads(line)
                if record.get("event") == "run_end":
                    return None if (record.get("detail") or {}).get("interrupted") else float(record["time"])
    except Exception:  # noqa: BLE001 - (a line a writer of the log folder appended: no end known)
        return None
    return None
