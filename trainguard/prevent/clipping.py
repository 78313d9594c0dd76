"""Gradient clipping thresholds: fixed norm, by value, or adaptive (z-score over an EMA, as ZClip).

Pure arithmetic; the adapter hands the threshold to the framework's own clipping (DeepSpeed's
optimizers clip inside their step, on the partitioned gradients) or clamps the local gradient in
its tensor hook (by value). Adaptive: the limit for a step is ``mean + z * std`` of an EMA of the
previous (clipped) global norms -- a norm that far above the recent distribution is cut back to
it, and the EMA is fed the clipped value so one burst does not raise the bar. It only tightens the framework's own
clip (DeepSpeed's ``gradient_clipping``, Megatron's ``--clip-grad``): never looser, unless
``clipping.exceed_framework_clip``.
"""
from __future__ import annotations

import math

from trainguard.config import ClippingConfig
from trainguard.detectors.stats import EMA


class Clipper:
    def __init__(self, cfg: ClippingConfig, framework_max_norm: float = 0.0):
        self.cfg = cfg
        self.framework_max_norm = framework_max_norm
        self.ema = EMA(cfg.ema)

    def max_norm(self) -> float | None:
        """The norm limit for the coming step; None: leave the framework's as configured."""
        if self.cfg.mode == "norm":
            return self.cfg.max_norm
        if self.cfg.mode == "adaptive":
            limit = self.cfg.max_norm if self.ema.count < self.cfg.warmup_steps else \
                max(self.ema.mean + self.cfg.z * self.ema.std, 1e-6)
            if self.framework_max_norm > 0 and not self.cfg.exceed_framework_clip:
                limit = min(limit, self.framework_max_norm)  # (never looser than the clip you configured)
            return limit
        return None

    def clipped(self, raw: float | None, limit: float) -> float | None:
        if raw is None or not math.isfinite(raw):
            return None
        return min(raw, limit) if limit and limit > 0 else raw

    def observe(self, raw: float | None, limit: float) -> None:
        """Feed the global norm of an applied step (after the fact). While the EMA warms up it learns
        the raw norms (the fixed max_norm still clips meanwhile); afterwards the clipped ones."""
        if self.cfg.mode == "adaptive" and self.ema.count < self.cfg.warmup_steps:
            value = raw if raw is not None and math.isfinite(raw) else None
        else:
            value = self.clipped(raw, limit)
        if value is not None:
            self.ema.push(value)

    def value_bound(self) -> float | None:
        return self.cfg.value if self.cfg.mode == "value" else None

    def state_dict(self) -> dict:
        return {"ema": self.ema.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.ema.load_state_dict(state["ema"])
