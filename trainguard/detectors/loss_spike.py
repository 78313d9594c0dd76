"""Loss spikes against robust windowed statistics, classified by what the gradient norm did.

A spike is a step whose loss lies more than ``z`` robust deviations (median / MAD over the last
``window`` healthy steps) above the median. Its class comes from the gradient-norm history
(:class:`trainguard.detectors.grad_norm.GradNormDetector` keeps it):

- ``slow_rise``: the gradient norm was trending up over the steps before the spike -- the LR is
  too high or the warmup too short. Remedy: lower the LR, lengthen the warmup.
- ``instant_burst``: no such trend; the gradient norm jumped within this one step -- a bad batch.
  Remedy: skip the batch, roll back past it. Unless the LR itself jumped within the last ``LR_LOOKBACK`` steps
  (a run resumed with a raised schedule): then it is the LR's, ``slow_rise``.

Spikes are not pushed into the window, so one bad batch does not shift the baseline. A spike must also give back
``min_regain`` of what the run has learnt (its height over the median against the first level's): once a loss
has fallen near its floor, its MAD is tiny and single hard samples stand many MADs above it -- the loss's own
tail, not a bad batch, which scores near where the run began.
"""
from __future__ import annotations

import math

from trainguard.config import LossSpikeConfig
from trainguard.verdicts import shared_or, Verdict
from trainguard.detectors.stats import RollingWindow

REMEDY = {
    "slow_rise": "lower the LR (or lengthen the warmup): the gradient norm was creeping up before the spike",
    "instant_burst": "skip this batch and roll back past it: the gradient norm jumped within one step",
}


LR_LOOKBACK = 10  # steps over which an LR jump is measured ...
LR_JUMP = 1.5     # ... and the ratio that makes a spike an LR's, not a batch's
FIRST = 5         # the first level: the median of the first FIRST losses


class LossSpikeDetector:
    name = "loss_spike"

    def __init__(self, cfg: LossSpikeConfig):
        self.cfg = cfg
        self.window = RollingWindow(cfg.window)
        self.first: float | None = None  # the first level: the median of the first FIRST losses
        self._bound: tuple | None = None  # (the window, its version, its median, its deviation): below()'s

    def observe(self, step: int, loss: float, trend: str | None, grad_z: float, ranks=(),
                lr_ratio: float | None = None) -> Verdict | None:
        """``trend``: the gradient detector's reading of the steps before this one ('rising' or
        None); ``grad_z``: how far this step's gradient norm jumped (robust z); ``lr_ratio``: the LR now over the
        LR ``LR_LOOKBACK`` steps ago (a schedule raised mid-run spikes the loss with no creep before it)."""
        if not math.isfinite(loss):
            return None  # the non-finite detector owns this step
        if len(self.window) < self.cfg.min_history:
            self.window.push(loss)
            if self.first is None and len(self.window) == FIRST:
                self.first = self.window.median()  # (where the run began, before its fast first fall)
            return None
        median = self.window.median()
        if self.first is None:  # (a window loaded from a guard state of before)
            self.first = median
        z = self.window.robust_z(loss)
        if z <= self.cfg.z or loss - median < self.cfg.min_regain * max(self.first - median, 0.0):
            self.window.push(loss)
            return None
        lr_jumped = lr_ratio is not None and lr_ratio > LR_JUMP
        kind = "slow_rise" if trend == "rising" or lr_jumped else "instant_burst"
        return Verdict(detector=self.name, anomaly=kind, ranks=shared_or(kind, ranks), detail={
            "loss": loss, "median": self.window.median(), "mad": self.window.mad(), "z": round(z, 2),
            "grad_z": round(grad_z, 2), "class": kind, "remedy": REMEDY[kind],
            **({"lr_ratio": round(lr_ratio, 3), "why": f"the LR rose x{lr_ratio:.2f} within the last {LR_LOOKBACK} "
                "steps"} if lr_jumped else {})})

    def below(self, loss: float) -> bool:
        """Whether :meth:`observe` cannot call ``loss`` a spike now: its robust z at most ``z`` (the window's median and
        deviation kept until the window moves: a clear step's check costs two comparisons), or the window still filling.
        A spike needs more (its regain too): this only ever says "cannot" where observe would find none."""
        w = self.window
        if len(w) < self.cfg.min_history:
            return True
        if self._bound is None or self._bound[0] is not w or self._bound[1] != w.version:
            self._bound = (w, w.version, w.median(), w.scale())
        _, _, median, scale = self._bound
        return (loss - median) / scale <= self.cfg.z

    def prime(self) -> None:
        """Where :meth:`below` is asked (a clear step's check, at the update's launch), its statistics taken now, after
        this step's DECIDE: the next check finds them kept."""
        if self._bound is not None:
            self.below(self._bound[2])

    def reset(self) -> None:
        """After a restart from the run's first step: the window's losses belong to a later stage of training,
        against which every early loss would look like a burst."""
        self.window = RollingWindow(self.window.size)

    def state_dict(self) -> dict:
        return {"window": self.window.state_dict(), "first": self.first}

    def load_state_dict(self, state: dict) -> None:
        self.window.load_state_dict(state["window"])
        self.first = state.get("first")
