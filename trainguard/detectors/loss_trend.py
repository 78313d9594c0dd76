"""A loss that climbs step by step, seen against its own recent best.

The spike detector (:mod:`trainguard.detectors.loss_spike`) judges one step against a median/MAD window
of healthy steps -- and a window absorbs a climb that comes one step at a time: each step is only a little
above the last, so none is a spike, and the window's median follows the loss up (Megatron-LM's
loss falling to ~2.4, then climbing for ~30 iterations to ~7.0, unanswered). This detector keeps the
*smoothed* loss (the median of the last ``smooth`` steps: one bad batch cannot move it) and the best level it
has reached (the median of ``4 x smooth`` steps: noise alone does not set it low); when the smoothed loss has
stood above that best by more than its band for ``patience`` steps, the run is diverging, whatever shape the
gradient norm has. The band knows the loss's own noise, not only a relative rise: it is the widest of ``rise`` x
the best, ``noise_z`` robust spreads of the raw losses of the window that set the best, and ``min_regain`` x what
the loss has fallen from its first level (its first smoothed loss) to its best (a loss near its floor wiggles by
half itself and more;
a divergence gives back what was learnt).

Its class comes from three signals together (:func:`classify`), not from one:

- ``slow_rise`` (lower the LR): the LR rose since the best loss (a warmup to too high a peak, a schedule
  raised on resume), or the gradient norm stands above its baseline, or the climb was gradual;
- ``instant_burst`` (roll back past the data): the loss jumped within a step and stayed up while the LR was
  flat and the gradient norm normal -- a stretch of bad data.

A **stalled start** is the other shape an LR too high from the first steps takes (a warmup of one step to a peak
5-25x too high): the loss never climbs from a best, it never leaves its first level -- the model collapses to the
tokens' marginal distribution, its gradient norm falls 15x while the loss stands. When a fresh run's LR has held its
peak (reached within that time: a warmup of a few steps) for the trend's settling time and its level is still
within ``stall_fall`` of where it began (the lower of its first level and the median of its first three losses: an
LR that jumps at once lifts the first steps') while its gradient norm fell to
1/``stall_grad_drop`` of its first (at its lowest since) -- judged until a second settling time has passed at the
peak --, the verdict is a ``slow_rise`` from the LR's peak (once a run).
Neither alone: a fine-tune that starts near its floor keeps its gradient norm, a run that learns brings its loss
down. A history that begins mid-run (a resume without the guard's state) has no first level to stall at.

Before the trend can speak, a fresh run's climb from where it began is judged apart (:mod:`trainguard.detectors.
early_climb`): a ``slow_rise`` from the loss's bottom, once, after ``min_history`` steps.

Its verdict carries ``onset_step``: the step of the best loss (a stall's: the LR's peak), which a rollback must not
go past.
Host floats only; the same numbers on every rank, so the same verdict everywhere.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Callable

from trainguard.config import LossTrendConfig
from trainguard.detectors.early_climb import EarlyClimb
from trainguard.verdicts import shared_or, Verdict

REMEDY = {
    "slow_rise": "lower the LR (or lengthen the warmup): the loss has been climbing away from its best",
    "instant_burst": "roll back past this stretch of data: the loss jumped and stayed up with the LR and "
                     "gradient norm unchanged",
}


def classify(lr_ratio: float | None, grad_ratio: float | None, jumped: bool) -> tuple[str, list[str]]:
    """The class of a climb and the evidence, in words. ``lr_ratio``: the LR now over the LR at the best
    loss; ``grad_ratio``: the gradient norm's median over the climb over its baseline median; ``jumped``:
    the loss left the band in one step and never came back into it."""
    why = []
    if lr_ratio is not None and lr_ratio > 1.05:
        why.append(f"the LR rose x{lr_ratio:.2f} since the best loss")
    if grad_ratio is not None and grad_ratio > 1.5:
        why.append(f"the gradient norm stands at x{grad_ratio:.2f} its baseline")
    if why:
        return "slow_rise", why
    if jumped:
        return "instant_burst", ["the loss jumped within one step and stayed up; LR and gradient norm unchanged"]
    return "slow_rise", ["the loss climbed step by step"]


class LossTrendDetector:
    name = "loss_trend"

    def __init__(self, cfg: LossTrendConfig):
        self.cfg = cfg
        self.raw: deque = deque(maxlen=max(4 * cfg.smooth, 4))   # (step, loss) of recent finite steps
        self.seen = 0
        self.best: float | None = None
        self.best_step = 0
        self.best_lr: float | None = None
        self.above = 0          # consecutive steps the smoothed loss stood above the band
        self.spread = 0.0       # the robust spread of the raw losses of the window that set the best
        self.first: float | None = None  # the loss's first level (the median of its first ``smooth`` losses)
        self.bests: deque = deque(maxlen=4096)  # (step, best, best_step, best_lr, spread) at each new best
        self.reported = False   # one verdict per episode (until the loss is back in its band)
        self.first_step: int | None = None   # the step of the first loss seen (a fresh run's: within ``smooth``)
        self.start: float | None = None      # where it began: the median of its first 3 losses
        self.head: list[float] = []           # (those losses)
        self.grads: deque = deque(maxlen=cfg.smooth)  # recent finite gradient norms
        self.first_grad: float | None = None  # the gradient norm's first level (the median of its first ``smooth``)
        self.low_grad: float | None = None    # the lowest level it has fallen to since (the median of ``smooth``)
        self.peak_lr, self.peak_step = 0.0, None  # the highest LR so far and the step it was reached
        self.stalled = False    # a stall is reported once a run
        self.low: float | None = None  # the lowest smoothed loss of this trajectory (what "up" is before a best)
        self.early = EarlyClimb(cfg)   # before a best: a fresh run's climb from where it began

    def smoothed(self) -> float | None:
        if len(self.raw) < self.cfg.smooth:
            return None
        return statistics.median(v for _, v in list(self.raw)[-self.cfg.smooth:])

    def level(self) -> float | None:
        """The loss's level for its best: the median of a window four times as long (the minimum of short medians
        of a noisy loss lies well below its true level, and a band over it would be crossed by noise alone)."""
        if len(self.raw) < self.raw.maxlen:
            return None
        return statistics.median(v for _, v in self.raw)

    def band(self, rise: float | None = None) -> float | None:
        """The smoothed loss above which the run counts as climbing away from its best: the widest of the relative
        rise (``rise``, default the config's), the loss's noise at its best and the fraction of what it learnt."""
        if self.best is None:
            return None
        learnt = max((self.first or self.best) - self.best, 0.0)
        rise = self.cfg.rise if rise is None else rise
        return self.best + max(rise * abs(self.best), self.cfg.noise_z * self.spread, self.cfg.min_regain * learnt)

    def standing_above(self, fraction: float) -> bool:
        """Whether the smoothed loss of the steps so far stands above the best level by more than ``fraction`` of it
        -- and more than the loss's noise and the floor of what it learnt (:meth:`band`). Before the trend knows a best
        (its level needs ``4 x smooth`` steps), the evidence there is: the smoothed loss more than ``fraction`` above
        the lowest it has been -- a loss that keeps falling is no climb, whatever the gradient norm does (a held-out
        healthy run's warmup raised its norm 45x in 20 steps while its loss fell from 4.85 to 3.94: it was restarted
        with a fourteenth of its LR). True while not even that is known."""
        s = self.smoothed()
        if s is None:
            return True
        if self.best is None:
            return self.low is None or s > self.low + fraction * abs(self.low)
        return s > self.band(fraction)

    def observe(self, step: int, loss: float, lr: float | None = None,
                grad_ratio: Callable[[int], float | None] | None = None,
                ranks=(), grad: float | None = None) -> Verdict | None:
        if not math.isfinite(loss):
            return None  # the non-finite detector owns this step
        self.raw.append((step, loss))
        self.seen += 1
        if self.first_step is None:
            self.first_step = step
        if len(self.head) < 3:  # (three: one unusually easy first batch does not set where the run began)
            self.head.append(loss)
            self.start = statistics.median(self.head) if len(self.head) == 3 else None
            if self.start is not None:
                self.early.began(step, self.start)  # (where the run began: the smoothed loss needs ``smooth`` steps)
        if grad is not None and math.isfinite(grad):
            self.grads.append(grad)
            if len(self.grads) == self.grads.maxlen:
                now = statistics.median(self.grads)
                self.first_grad = now if self.first_grad is None else self.first_grad
                self.low_grad = now if self.low_grad is None else min(self.low_grad, now)
        self.early.lr_seen(lr)
        if lr is not None and math.isfinite(lr) and lr > self.peak_lr * (1 + 1e-6):
            self.peak_lr, self.peak_step = lr, step
        s = self.smoothed()
        if s is None:
            return None
        if self.first is None and len(self.raw) >= self.cfg.smooth:
            self.first = s  # (the first smoothed loss: where the run began, before its fast first fall)
        self.low = s if self.low is None else min(self.low, s)
        self.early.learning(s)
        if self.best is None:  # (before the trend can speak: a fresh run's climb, trainguard.detectors.early_climb)
            vals = [v for _, v in self.raw]
            self.early.observe(step, s, vals[-self.cfg.smooth:], vals, lr)
            fresh = self.first_step is not None and self.first_step <= self.cfg.smooth
            early = self.early.verdict(self.seen, fresh, loss, lr, vals[-self.cfg.smooth:], vals, ranks)
            if early is not None:
                return early
        level = self.level()
        stall = self._stall(step, loss, level, ranks)
        if stall is not None:
            return stall
        if level is not None and (self.best is None or level < self.best):
            # (the step at the centre of the window that set it: a rollback goes back before the climb, not to its top)
            self.best, self.best_step, self.best_lr = level, self.raw[len(self.raw) // 2][0], lr
            self.spread = 1.4826 * statistics.median(abs(v - level) for _, v in self.raw)
            self.bests.append((step, self.best, self.best_step, self.best_lr, self.spread))
        if self.best is None:
            return None
        band = self.band()
        if s <= band:
            self.above, self.reported = 0, False
            return None
        self.above += 1
        if self.seen < self.cfg.min_history or self.above < self.cfg.patience or self.reported:
            return None
        self.reported = True
        lr_ratio = lr / self.best_lr if lr and self.best_lr else None
        # (``grad_ratio(since)``: the gradient norm over the climb against its baseline, asked only for a verdict)
        grad_ratio = grad_ratio(self.best_step) if grad_ratio is not None else None
        kind, why = classify(lr_ratio, grad_ratio, self._jumped(band))
        return Verdict(detector=self.name, anomaly=kind, ranks=shared_or(kind, ranks), detail={
            "loss": loss, "smoothed": round(s, 4), "best": round(self.best, 4), "best_step": self.best_step,
            "rise": round((s - self.best) / abs(self.best), 4) if self.best else None, "limit_rise": self.cfg.rise,
            "band": round(band, 4), "noise": round(self.spread, 4), "first_level": self.first,
            "lr_ratio": None if lr_ratio is None else round(lr_ratio, 3),
            "grad_ratio": None if grad_ratio is None else round(grad_ratio, 3),
            "class": kind, "evidence": why, "onset_step": self.best_step + 1, "remedy": REMEDY[kind]})

    def _stall(self, step: int, loss: float, level: float | None, ranks) -> Verdict | None:
        """A fresh run that learns nothing at its peak LR (the module's docstring), once."""
        cfg = self.cfg
        if not cfg.stall_fall or self.stalled or level is None or self.first is None or self.first_grad is None \
                or self.peak_step is None or self.first_step is None or self.first_step > cfg.smooth \
                or self.peak_step - self.first_step > cfg.settle \
                or not cfg.settle <= step - self.peak_step <= 2 * cfg.settle or len(self.grads) < self.grads.maxlen:
            # (judged while the run is young: its peak reached within the trend's settling time -- a warmup that short
            # is what fails so --, then between one and two settling times at it; after a long warmup, a fine-tune's
            # norm may well have fallen 4x at a loss never far above its floor)
            return None
        # (from the lower of the first level and where the run began: an LR that jumps at once lifts the first steps'
        # -- dev seed s21: 4.9 -> 9.1 at step 8, then down to a stall at 4.4)
        first = min(self.first, self.start) if self.start is not None else self.first
        fell = (first - level) / abs(first) if first else 0.0
        grad_now = self.low_grad  # (the collapse: a dead model's norm creeps back up as it starts, slowly, to learn)
        if fell >= cfg.stall_fall or grad_now * cfg.stall_grad_drop > self.first_grad:
            return None
        self.stalled = True
        kind = "slow_rise"
        why = [f"the loss stands {fell:.0%} below its first level ({first:.4g}) after {step - self.peak_step} "
               f"steps at its peak LR ({self.peak_lr:.3g})",
               f"the gradient norm fell x{self.first_grad / max(grad_now, 1e-30):.3g} below its first level: the "
               "model moved and learnt nothing"]
        return Verdict(detector=self.name, anomaly=kind, ranks=shared_or(kind, ranks), detail={
            "loss": loss, "level": round(level, 4), "first_level": first, "fell": round(fell, 4),
            "limit_fall": cfg.stall_fall, "grad_first": round(self.first_grad, 4), "grad_low": round(grad_now, 4),
            "limit_grad_drop": cfg.stall_grad_drop, "peak_lr": self.peak_lr, "class": kind, "stall": True,
            "evidence": why, "onset_step": self.peak_step,
            "remedy": "lower the LR (or lengthen the warmup): the run stalled at its first level from its peak LR"})

    def early_climb(self, before: int) -> int | None:
        """Where the loss stopped falling, where a fresh run climbed from it by step ``before`` while the trend could
        not yet speak (trainguard.detectors.early_climb; None: it did not): the LR range test's evidence in a young
        run's bf16 start-over (trainguard.recovery.lrcut.LrHistory.range_cut)."""
        return self.early.named(before)

    def _jumped(self, band: float) -> bool:
        """Whether the loss left the band in one step and stayed out: the first recent step above the band was
        followed only by steps above it (a gradual climb wanders back into the band now and then)."""
        vals = [v for _, v in list(self.raw)[-2 * self.cfg.smooth:]]
        first = next((i for i, v in enumerate(vals) if v > band), None)
        return first is not None and first > 0 and all(v > band for v in vals[first:])

    def rolled_back(self, to_step: int | None = None) -> None:
        """The run went back to a checkpoint of ``to_step``: the climb measured on the abandoned trajectory is void,
        and the best is the one the run had at ``to_step`` (a later best, from steps the rollback undid, would make
        the loss of an earlier checkpoint look like a climb)."""
        self.raw.clear()
        self.above, self.reported, self.low = 0, False, None
        self.early.rolled_back(to_step)
        self.stalled = True  # (a stall is judged on the run's first trajectory only: after a rollback its peak, its
        # gradient's first level and low belong to the steps undone)
        if to_step is None:
            return
        while len(self.bests) > 1 and self.bests[-1][0] > to_step:
            self.bests.pop()
        if self.bests and self.bests[-1][0] > to_step:  # (no best known as of to_step: learnt again)
            self.bests.pop()
        _, self.best, self.best_step, self.best_lr, self.spread = self.bests[-1] if self.bests else \
            (0, None, 0, None, 0.0)

    def state_dict(self) -> dict:
        return {"best": self.best, "best_step": self.best_step, "best_lr": self.best_lr, "seen": self.seen,
                "spread": self.spread, "first": self.first, "first_step": self.first_step,
                "start": self.start, "head": self.head, "first_grad": self.first_grad, "low_grad": self.low_grad, "peak_lr": self.peak_lr, "peak_step": self.peak_step,
                "stalled": self.stalled, "low": self.low, **self.early.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.best_step = state.get("best"), int(state.get("best_step", 0))
        self.best_lr, self.seen = state.get("best_lr"), int(state.get("seen", 0))
        self.spread, self.first = float(state.get("spread") or 0.0), state.get("first")
        # (a state from before the stall rule: its first step unknown -- no stall judged on it)
        self.first_step = state.get("first_step", self.cfg.smooth + 1 if self.first is not None else None)
        self.first_grad, self.stalled = state.get("first_grad"), bool(state.get("stalled", False))
        self.low_grad, self.start, self.head = state.get("low_grad"), state.get("start"), list(state.get("head", []))
        self.peak_lr, self.peak_step = float(state.get("peak_lr") or 0.0), state.get("peak_step")
        self.low = state.get("low")
        self.early.load_state_dict(state)
        # (the best as of the checkpoint: a rollback to it, or to a later one, comes back to it)
        self.bests = deque([(self.best_step, self.best, self.best_step, self.best_lr, self.spread)]
                           if self.best is not None else [], maxlen=self.bests.maxlen)
        self.raw.clear()
        self.above, self.reported = 0, False
