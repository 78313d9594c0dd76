"""Streaming statistics for detectors: a rolling window (median, MAD, robust z, trend slope) and
an exponential moving average with variance. Host floats only; state survives checkpoints."""
from __future__ import annotations

import math
from collections import deque
from typing import Iterable


class RollingWindow:
    """The last ``size`` finite values."""

    def __init__(self, size: int):
        if size < 3:
            raise ValueError(f"window size must be >= 3, got {size}")
        self.size = size
        self.values: deque[float] = deque(maxlen=size)
        self.version = 0  # (counts the changes: what a cached statistic is keyed by)

    def __len__(self) -> int:
        return len(self.values)

    def push(self, x: float) -> None:
        if x is not None and math.isfinite(x):
            self.values.append(float(x))
            self.version += 1

    def median(self) -> float:
        return _median(self.values)

    def mad(self) -> float:
        """Median absolute deviation, scaled to estimate a standard deviation (x1.4826)."""
        m = self.median()
        return 1.4826 * _median(abs(v - m) for v in self.values)

    def robust_z(self, x: float, floor: float = 1e-8) -> float:
        """(x - median) / MAD. The MAD is floored at ``floor`` times the median's magnitude, so a
        perfectly flat history does not turn every wiggle into an infinite z."""
        if not self.values:
            return 0.0
        return (x - self.median()) / self.scale(floor)

    def log_robust_z(self, x: float, floor: float = 1e-3) -> float:
        """:meth:`robust_z` of log(x) among the logs of the window's positive values: how many robust deviations a
        *ratio* to the median is, for a positive quantity whose noise scales with it (a healthy gradient norm near a
        loss floor moves up to 17x from one step to the next, where early in the run it moved by a few percent). The
        deviation is floored at ``floor`` (0.1%: the linear z's floor, as a ratio)."""
        logs = [math.log(v) for v in self.values if v > 0]
        if not logs or not x > 0:
            return 0.0
        m = _median(logs)
        return (math.log(x) - m) / max(1.4826 * _median(abs(v - m) for v in logs), floor)

    def scale(self, floor: float = 1e-8) -> float:
        """The MAD, floored (see :meth:`robust_z`)."""
        m = self.median()
        return max(self.mad(), abs(m) * 1e-3, floor)

    def slope(self, last: int | None = None, log: bool = False) -> float:
        """Least-squares slope per step of the last ``last`` values (of log values if ``log``)."""
        vals = list(self.values)[-last:] if last else list(self.values)
        if log:
            vals = [math.log(v) for v in vals if v > 0]
        n = len(vals)
        if n < 3:
            return 0.0
        mx = (n - 1) / 2
        my = sum(vals) / n
        sxx = sum((i - mx) ** 2 for i in range(n))
        return sum((i - mx) * (v - my) for i, v in enumerate(vals)) / sxx

    def state_dict(self) -> dict:
        return {"size": self.size, "values": list(self.values)}

    def load_state_dict(self, state: dict) -> None:
        self.size = int(state["size"])
        self.values = deque((float(v) for v in state["values"]), maxlen=self.size)
        self.version += 1


class EMA:
    """Exponential moving mean and variance (West's incremental form), with bias correction."""

    def __init__(self, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.mean = 0.0
        self.var = 0.0
        self.count = 0

    def push(self, x: float) -> None:
        if x is None or not math.isfinite(x):
            return
        if self.count == 0:
            self.mean, self.var = float(x), 0.0
        else:
            a = 1.0 - self.decay
            diff = x - self.mean
            incr = a * diff
            self.mean += incr
            self.var = (1.0 - a) * (self.var + diff * incr)
        self.count += 1

    @property
    def std(self) -> float:
        return math.sqrt(max(self.var, 0.0))

    def z(self, x: float) -> float:
        if self.count < 2 or self.std == 0.0:
            return 0.0
        return (x - self.mean) / self.std

    def state_dict(self) -> dict:
        return {"decay": self.decay, "mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.decay, self.mean = float(state["decay"]), float(state["mean"])
        self.var, self.count = float(state["var"]), int(state["count"])


def _median(values: Iterable[float]) -> float:
    s = sorted(values)
    n = len(s)
    if n == 0:
        return float("nan")
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])
