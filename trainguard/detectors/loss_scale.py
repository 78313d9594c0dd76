"""The fp16 dynamic loss scaler, watched: a collapse is caught on the step DeepSpeed would stop.

A dynamic loss scaler halves its scale on every overflowing step (after its hysteresis) and grows
it again after ``scale_window`` clean steps. Overflows are routine; a *collapse* is not: the
scaler reaches its minimum and still overflows (DeepSpeed raises "Current loss scale already at
minimum" there; megatron's scaler clamps silently and skips forever), or it overflows step after
step once it had found a working scale. Both are verdicts of class ``loss_scale``; the recovery
ladder of that class decides (roll back and reset the scale, raise the floor, fall back to bf16).

Host floats only: the adapter reads the scaler's attributes, which need no device sync.
"""
from __future__ import annotations

from trainguard.config import LossScaleConfig
from trainguard.verdicts import ScalerState, Verdict
from trainguard.events import Anomaly

ONSET_GAP = 10  # overflows at most this many steps apart belong to one descent


class LossScaleWatch:
    def __init__(self, cfg: LossScaleConfig):
        self.cfg = cfg
        self.streak = 0
        self.found_working_scale = False
        self.overflows: list[int] = []  # recent overflow steps, for the descent's onset

    def observe(self, step: int, before: ScalerState, overflowed: bool) -> Verdict | None:
        """One optimizer step: the scaler as it was when the step began, and whether it overflowed."""
        if not overflowed:
            self.streak = 0
            self.found_working_scale = True
            return None
        self.streak += 1
        self.overflows = [s for s in self.overflows if s > step - 10 * ONSET_GAP and s < step] + [step]
        at_floor = before.scale <= before.min_scale and (before.hysteresis is None or before.hysteresis <= 1)
        streak = self.found_working_scale and self.streak >= self.cfg.max_overflow_streak
        if not (at_floor or streak):
            return None
        why = (f"fp16 loss scale overflowed at its minimum {before.min_scale:g}" if at_floor else
               f"{self.streak} overflowing steps in a row (max_overflow_streak={self.cfg.max_overflow_streak})")
        return Verdict(detector="loss_scale", anomaly=Anomaly.LOSS_SCALE, ranks=(), detail={
            "why": why, "scale": before.scale, "min_scale": before.min_scale, "streak": self.streak,
            "onset_step": self.onset(), "at_floor": at_floor})

    def onset(self) -> int | None:
        """First overflow of the latest descent (overflows no more than ONSET_GAP steps apart)."""
        if not self.overflows:
            return None
        first = self.overflows[-1]
        for s in reversed(self.overflows[:-1]):
            if first - s > ONSET_GAP:
                break
            first = s
        return first

    def reset(self) -> None:
        """After a rollback or a precision change: a fresh descent."""
        self.streak = 0
        self.overflows = []
