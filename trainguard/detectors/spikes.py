"""The loss and gradient statistics -- loss spike, gradient norm, loss trend -- as one registered detector.

The three read one another, so they run together, in this order: the gradient's creep counts only while the loss
stands above its level (``loss_trend.standing_above``); a loss spike is classified by the gradient's trend before
the step and its z (``instant_burst`` or ``slow_rise``); after the weights check, a burst the weights do not explain
was a bad batch -- its loss and norm are no evidence about the LR (they leave the gradient's creep and surge count,
and the loss trend does not see them) -- and any other step's loss goes to the loss trend, classified by the
gradient's ratio since its onset. None of them runs on a step whose values were not finite. Each keeps its own
config section (``detectors.loss_spike``, ``.grad_norm``, ``.loss_trend``) and its ``enabled``.

Besides its verdicts, the windows answer the guard's questions: whether a loss is healthy (the replays', the
suspects'), the loss median of the metric line, where a gradient rise began (the rollback's target).
"""
from __future__ import annotations

import math

import torch

from trainguard.detectors.grad_norm import GradNormDetector
from trainguard.detectors.loss_spike import LossSpikeDetector
from trainguard.detectors.loss_trend import LossTrendDetector
from trainguard.detectors.registry import Decide, Registration
from trainguard.ranks.reduced import losses
from trainguard.replay.replay import judge_loss
from trainguard.verdicts import Verdict


class Spikes:
    def __init__(self, cfg, device=None):  # (cfg: trainguard.config.DetectorsConfig, the three sections)
        self.cfg = cfg
        self.loss_spike = LossSpikeDetector(cfg.loss_spike)
        self.grad_norm = GradNormDetector(cfg.grad_norm)
        self.loss_trend = LossTrendDetector(cfg.loss_trend)

    # ------------------------------------------------------------------ the two rounds of DECIDE
    def early(self, step: int, ctx: Decide) -> list[Verdict]:
        """From the summary: the gradient's surge or creep, then the loss spike (classified by the gradient)."""
        if ctx.nonfinite is not None:
            return []
        s, found = ctx.summary, []
        if self.cfg.grad_norm.enabled:
            rising_before = self.grad_norm.trend()
            loss_up = not self.cfg.loss_trend.enabled or self.loss_trend.standing_above(0.05)
            found += self.grad_norm.observe(step, s.grad_proxy, ranks=[s.grad_rank], loss_up=loss_up)
        else:
            rising_before = None
        lr_ratio = ctx.lr_ratio()
        if self.cfg.loss_spike.enabled:
            v = self.loss_spike.observe(step, s.loss_mean, rising_before, self.grad_norm.last_z,
                                        ranks=[s.loss_rank], lr_ratio=lr_ratio)
            if v is not None:
                found.append(v)
            self.loss_spike.prime()  # (its window moved: the next clear step's check finds its statistics kept)
        return found

    def clear(self, step: int, s) -> bool:
        """Nothing here can refuse this step's update (trainguard.step.launchgate): a finite gradient proxy and a loss
        the loss-spike detector cannot call a burst (its window's statistics, kept: two comparisons). A creep, a
        trend or a surge found after the launch is one step late -- a rollback discards the update, an alert says so."""
        if s.grad_proxy is not None and not math.isfinite(s.grad_proxy):
            return False
        return not self.cfg.loss_spike.enabled or (math.isfinite(s.loss_mean) and self.loss_spike.below(s.loss_mean))

    def observe(self, step: int, ctx: Decide) -> list[Verdict]:
        """After the weights check: a burst the weights do not explain leaves the gradient's creep (its slow_rise
        withdrawn when the data is to blame); any other step's loss goes to the loss trend (one record per class)."""
        if ctx.nonfinite is not None:
            return []
        s = ctx.summary
        if any(v.anomaly == "instant_burst" for v in ctx.found) and ctx.weights != "damaged":
            if self.grad_norm.blame_data(step):
                ctx.found[:] = [v for v in ctx.found if not (v.detector == "grad_norm" and v.anomaly == "slow_rise")]
            return []
        if self.cfg.loss_trend.enabled:
            v = self.loss_trend.observe(step, s.loss_mean, ctx.lr, self.grad_norm.ratio_since, ranks=[s.loss_rank],
                                        grad=s.grad_proxy)
            if v is not None and not any(f.anomaly == v.anomaly for f in ctx.found):
                return [v]
        return []

    # ------------------------------------------------------------------ what the windows answer
    def healthy_loss(self, loss: float) -> bool:
        w = self.loss_spike.window
        robust_z = w.robust_z if len(w) >= self.cfg.loss_spike.min_history else None
        return judge_loss(loss, robust_z, self.cfg.loss_spike.z)

    def unhealthy(self, obs) -> list[int]:
        """The ranks whose own loss was not healthy this step (the suspects' evidence of a shared failure): from the
        rows where every rank's are here, else from the table's loss columns, judged the same way at once."""
        if obs.full:
            return [o.rank for o in obs if o.has_loss and not (o.loss_finite and self.healthy_loss(o.loss))]
        has, loss, ok = losses(obs.rows_table())
        bad = ~ok
        w = self.loss_spike.window
        if len(w) >= self.cfg.loss_spike.min_history:
            bad = bad | ((loss - w.median()) / w.scale() > self.cfg.loss_spike.z)
        return torch.nonzero(has & bad).flatten().tolist()

    def loss_median(self) -> float | None:
        return self.loss_spike.window.median() if len(self.loss_spike.window) else None

    def early_climb(self, before: int) -> int | None:
        """Where the loss stopped falling before it climbed, in the steps before the trend can speak (None: it did not)."""
        return self.loss_trend.early_climb(before)

    def rise_onset(self, step: int) -> int | None:
        """Where the gradient's current rise began (None: not in one)."""
        return self.grad_norm.onset(step) if self.grad_norm.in_rise else None

    # ------------------------------------------------------------------ what the run did
    def rewound(self, step: int, to_step: int, restart: bool = False) -> None:
        """The gradient's episode starts again; after a ``restart`` from the run's first step the loss and norm
        windows too (they describe a later stage of training); the loss trend forgets what came after ``to_step``."""
        self.grad_norm.reset_trend()
        if restart:
            self.loss_spike.reset()
            self.grad_norm.reset()
        self.loss_trend.rolled_back(to_step)

    def lr_lowered(self) -> None:
        """What goes on at the lowered LR is a new episode of the gradient's trend."""
        self.grad_norm.reset_trend()

    def precision_changed(self) -> None:
        """Another precision: a new gradient-norm distribution from here."""
        self.grad_norm.reset()

    def state_dict(self) -> dict:
        return {"loss_spike": self.loss_spike.state_dict(), "grad_norm": self.grad_norm.state_dict(),
                "loss_trend": self.loss_trend.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.loss_spike.load_state_dict(state["loss_spike"])
        self.grad_norm.load_state_dict(state["grad_norm"])
        if "loss_trend" in state:
            self.loss_trend.load_state_dict(state["loss_trend"])


REGISTRATION = Registration(key=None, build=Spikes, order=20)
