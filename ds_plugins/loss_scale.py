"""DeepSpeed's fp16 dynamic loss scaler, read and adjusted in one place.

Two shapes exist in DeepSpeed 0.19: ZeRO 1-3 keep a ``DynamicLossScaler`` in
``optimizer.loss_scaler`` (``cur_scale``, ``min_scale``, ``cur_hysteresis``; it *raises* "Current
loss scale already at minimum" on an overflow at the floor), and ZeRO-0's ``FP16_Optimizer`` keeps
``optimizer.loss_scale_config`` (``cur_scale``, ``min_loss_scale``; it clamps at the floor and
skips forever; DeepSpeed 0.16-0.17's ``FP16_Optimizer``/``FP16_UnfusedOptimizer`` keep those fields on
themselves). Every value here is a host float: reading it costs no device sync.

A checkpoint load replaces the ZeRO scaler object with the pickled one, so :meth:`arm` must run
again after every load (the adapter does).
"""
from __future__ import annotations

from trainguard.ports import ScalerState


class ScalerView:
    def __init__(self, engine):
        self.engine = engine
        self.floor: float | None = None  # a raised min scale, re-applied after every load

    def _scaler(self):
        opt = self.engine.optimizer
        # (DeepSpeed 0.16-0.17's ZeRO-0 fp16 optimizers keep the same fields on themselves: the last candidate)
        for obj in (getattr(opt, "loss_scaler", None), getattr(opt, "loss_scale_config", None), opt):
            if obj is not None and (getattr(obj, "dynamic", False) or getattr(obj, "dynamic_loss_scale", False)):
                return obj
        return None

    def active(self) -> bool:
        return self.engine.fp16_enabled() and self._scaler() is not None

    def state(self) -> ScalerState | None:
        s = self._scaler() if self.engine.fp16_enabled() else None
        if s is None:
            return None
        if hasattr(s, "min_scale"):  # DynamicLossScaler
            hyst = int(s.cur_hysteresis) if getattr(s, "delayed_shift", 1) > 1 else None
            return ScalerState(float(s.cur_scale), float(s.min_scale), hyst)
        return ScalerState(float(s.cur_scale), float(s.min_loss_scale), None)

    def arm(self) -> None:
        """The guard owns the decision at the floor: DeepSpeed's own stop is disarmed (the
        loss_scale ladder acts instead), and a raised floor is put back after a load."""
        s = self._scaler()
        if s is None:
            return
        if hasattr(s, "raise_error_at_min_scale"):
            s.raise_error_at_min_scale = False
        if self.floor is not None:
            self._set_min(s, self.floor)

    def reset(self) -> dict:
        """Back to the configured initial scale, hysteresis refilled, growth window restarted."""
        s = self._scaler()
        if s is None:
            return {}
        before = float(s.cur_scale)
        scale = float(self.engine.initial_dynamic_scale())
        if self.floor is not None:
            scale = max(scale, self.floor)
        s.cur_scale = scale
        if hasattr(s, "delayed_shift"):
            s.cur_hysteresis = s.delayed_shift
        s.last_overflow_iter = s.cur_iter
        return {"scale_before": before, "scale_after": scale}

    def raise_floor(self, factor: float) -> dict:
        s = self._scaler()
        if s is None:
            return {}
        old = float(getattr(s, "min_scale", getattr(s, "min_loss_scale", 1.0)))
        self.floor = old * factor
        self._set_min(s, self.floor)
        return {"min_scale_before": old, "min_scale_after": self.floor}

    @staticmethod
    def _set_min(s, value: float) -> None:
        if hasattr(s, "min_scale"):
            s.min_scale = value
        else:
            s.min_loss_scale = value
        if s.cur_scale < value:
            s.cur_scale = value


def _loss_scale(engine) -> float:
    """The fp16 dynamic loss scale (1.0 when there is none). Host floats: no device sync."""
    if not engine.fp16_enabled():
        return 1.0
    opt = engine.optimizer
    for obj in (opt, getattr(opt, "loss_scaler", None), getattr(opt, "loss_scale_config", None)):
        value = getattr(obj, "cur_scale", None)
        if isinstance(value, (int, float)):
            return float(value)
    return 1.0
