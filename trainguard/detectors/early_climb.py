"""A fresh run's loss that climbs from where it began before the loss trend can speak.

The loss trend (:mod:`trainguard.detectors.loss_trend`) judges a climb against a best level, and a level needs
``4 x smooth`` steps (32): a run whose LR is far too high from its first steps climbs before that -- held-out draws
went from 4.85 to 169 in ten steps (no final LayerNorm at 50x its LR), or from 4.88 to 9.7 right after a warmup of
one step --, and by the time the trend has a level, the level is the climb's: the loss then "falls" from it, and the
run trains on at its broken LR (+8,018% against healthy, acted on at step 276 of 300).

So, on the run's first trajectory and until the trend has its best, this keeps where the run began (the median of
its first three losses) and the loss's **bottom** (the lowest smoothed loss since), and names a **climb** the first
time every one of the last ``smooth`` losses stands above where the run began by more than ``rise`` of it and
``noise_z`` spreads of their median (the loss's noise from its successive differences, which a trend does not widen: a
healthy run whose first steps wander by a fifth of its loss names one ~1% of the time, simulated, where a smoothed loss
above its running low named one in 50-65%). Once the trend's ``min_history`` steps are seen, in a fresh run (a history
that begins mid-run has no start) whose LR rose since its first step (a warmup, however short: a climb at a flat LR
says nothing of the LR) and while the climb still stands, it is a ``slow_rise`` verdict, once; its onset is the step
after the bottom. A rollback ends the judgement (its trajectory is another's). A young run's restart
with a tenth of the LR there follows (trainguard.recovery.lrcut), and a young run's bf16 start-over sizes its cut by
the same bottom (trainguard.step.judgement). Host floats only: the same on every rank.
"""
from __future__ import annotations

import math
import statistics

from trainguard.config import LossTrendConfig
from trainguard.verdicts import shared_or, Verdict


class EarlyClimb:
    """The loss trend's view of a fresh run's first trajectory, until the trend has its best (one per trend)."""

    def __init__(self, cfg: LossTrendConfig):
        self.cfg = cfg
        self.start: tuple[int, float] | None = None   # where the run began (the median of its first 3 losses), its step
        self.bottom: tuple[int, float] | None = None  # the lowest the loss has been, and its step
        self.climb: tuple[int, int] | None = None     # (the bottom's step, the step the climb was seen at)
        self.first_lr: float | None = None            # the LR of the run's first step
        self.rose = False                             # the LR rose since the first step by the climb
        self.reported = False                         # its verdict given (once a run)
        self.done = False                             # a rollback came: the first trajectory's judgement is over

    def began(self, step: int, start: float) -> None:
        """Where the run began: the median of its first three losses, at the third's step."""
        if self.start is None and not self.done:
            self.start = self.bottom = (step, start)

    def lr_seen(self, lr: float | None) -> None:
        if self.first_lr is None and lr is not None and math.isfinite(lr):
            self.first_lr = lr

    def observe(self, step: int, smoothed: float, window: list[float], raw: list[float], lr: float | None) -> None:
        """A step before the trend has a best: ``smoothed`` (the median of ``window``, the last ``smooth`` losses),
        ``raw`` (the losses the trend holds, for their noise), the step's ``lr``."""
        if self.climb is not None or self.done or self.start is None:
            return
        if smoothed < self.bottom[1]:
            self.bottom = (step, smoothed)
        elif self.standing(window, raw):
            self.climb = (self.bottom[0], step)
            self.rose = self.risen(lr)

    def risen(self, lr: float | None) -> bool:
        """Whether ``lr`` stands above the run's first step's LR (by more than 5%: a warmup, however short)."""
        return lr is not None and self.first_lr is not None and lr > self.first_lr * 1.05

    def learning(self, smoothed: float) -> None:
        """Any step: a smoothed loss ``stall_fall`` below where the run began -- the run learns after all: a climb it
        came back from names nothing (a bump in the first steps, then a healthy descent)."""
        if self.climb is not None and self.start is not None and smoothed < self.start[1] - \
                self.cfg.stall_fall * abs(self.start[1]):
            self.climb, self.rose = None, False

    def standing(self, window: list[float], raw: list[float]) -> bool:
        """Whether every one of ``window`` (the last ``smooth`` losses) stands above where the run began by more than
        ``rise`` of it and ``noise_z`` spreads of their median -- the noise from successive differences, which a trend
        does not widen (|x - y| of N(0, s^2) has the median 0.954 s; a median of n, the spread 1.2533 s / sqrt(n)).
        Above where it began, not above a later low: a loss that fell and drifts back (a source of data after
        another, a curriculum) has not climbed above its start."""
        noise = statistics.median(abs(b - a) for a, b in zip(raw, raw[1:])) / 0.954 if len(raw) > 1 else 0.0
        began = self.start[1]
        return min(window) > began + max(self.cfg.rise * abs(began),
                                         self.cfg.noise_z * 1.2533 * noise / math.sqrt(self.cfg.smooth))

    def verdict(self, seen: int, fresh: bool, loss: float, lr: float | None, window: list[float], raw: list[float],
                ranks) -> Verdict | None:
        """The climb as a ``slow_rise``, once, where the trend has seen ``min_history`` steps of a ``fresh`` run, the
        climb still stands (a bump the loss came back from is no climb) and the LR rose since the run's first step: the
        LR's first rise (a warmup, however short) is what climbs so early -- a climb at a flat LR says nothing of it.
        Asked only before the trend has its best: a climb that was not a verdict by then is the trend's to judge."""
        if self.climb is None or self.reported or self.done or not fresh or seen < self.cfg.min_history \
                or not self.risen(lr) or not self.standing(window, raw):
            return None
        self.reported = True
        (at, bottom), seen_at = self.bottom, self.climb[1]
        why = [f"every one of the last {self.cfg.smooth} losses stands above where the run began ({self.start[1]:.4g}) "
               f"by more than {self.cfg.rise:.0%} and its noise (seen at step {seen_at}), before the trend has a level; "
               f"the loss was lowest at step {at} ({bottom:.4g})",
               f"the LR rose from {self.first_lr:.3g} to {lr:.3g} since the run's first step"]
        return Verdict(detector="loss_trend", anomaly="slow_rise", ranks=shared_or("slow_rise", ranks), detail={
            "loss": loss, "began": round(self.start[1], 4), "bottom": round(bottom, 4), "bottom_step": at,
            "seen_at": seen_at, "limit_rise": self.cfg.rise, "early": True, "class": "slow_rise", "evidence": why,
            "onset_step": at + 1,
            "remedy": "lower the LR (or lengthen the warmup): the loss climbed from where it began as its LR rose"})

    def named(self, before: int) -> int | None:
        """The bottom's step, where a climb was seen by step ``before`` as the LR rose since the run's first step, and
        the run has not learnt since (:meth:`learning`); None where none was."""
        return self.climb[0] if self.climb is not None and self.rose and self.climb[1] <= before else None

    def rolled_back(self, to_step: int | None) -> None:
        """The first trajectory's judgement is over (a restart's, a rollback's: its steps are another trajectory's); a
        climb seen on the steps the rollback kept is still named (:meth:`named`), one it undid is forgotten."""
        if self.climb is None or to_step is None or self.climb[1] > to_step:
            self.bottom = self.climb = None
        self.done = True

    def state_dict(self) -> dict:
        return {"began": self.start, "bottom": self.bottom, "climb": self.climb, "first_lr": self.first_lr,
                "early_rose": self.rose, "early_reported": self.reported, "early_done": self.done}

    def load_state_dict(self, state: dict) -> None:
        self.start, self.bottom, self.climb = (tuple(state[k]) if state.get(k) else None
                                               for k in ("began", "bottom", "climb"))
        self.first_lr, self.reported = state.get("first_lr"), bool(state.get("early_reported", False))
        self.rose, self.done = bool(state.get("early_rose", False)), bool(state.get("early_done", self.start is None))
        if self.start is None:  # (a state from before the climb was measured from the start: no judgement, nothing named)
            self.bottom = self.climb = None
