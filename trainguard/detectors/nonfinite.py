"""Non-finite loss or gradients on a rank's *local* values.

Under data parallelism one rank's NaN reaches every rank through the gradient all-reduce; looking
at the local values (checked before the reduction) is what names the rank that produced it.
"""
from __future__ import annotations

from typing import Sequence

from trainguard.ranks.attribution import narrow_to_origin
from trainguard.detectors.registry import Decide, Registration
from trainguard.verdicts import RankObservation, Verdict
from trainguard.events import Anomaly


def detect_nonfinite(observations: Sequence[RankObservation], scaled: bool = False) -> Verdict | None:
    """Return a verdict naming every rank whose local loss or local gradients were NaN/Inf.

    ``scaled`` (an fp16 dynamic loss scale is on): gradients that overflowed while every loss was
    finite are the scaler's routine business -- anomaly ``overflow``, which skips the step and
    lets the scaler lower its scale (the loss-scale watch catches a collapse) -- not ``nonfinite``.

    ``origin`` per rank: ``"loss"`` when the loss itself was non-finite (the gradients then are
    too), ``"gradients"`` when the loss was finite but the backward pass produced NaN/Inf (an
    overflow inside backward, or an fp16 loss scale too high).
    """
    culprits = {}
    for ob in observations:
        if ob.loss_finite and ob.grad_finite:
            continue
        culprits[ob.rank] = {
            "origin": "loss" if not ob.loss_finite else "gradients",
            "loss": ob.loss,
            "nonfinite_micro_batches": ob.loss_nonfinite,
            "micro_batches": ob.micro_batches,
            "local_grad_norm": ob.grad_norm,
        }
    if not culprits:
        return None
    overflow = scaled and all(c["origin"] == "gradients" for c in culprits.values())
    return Verdict(detector="nonfinite", anomaly=Anomaly.OVERFLOW if overflow else Anomaly.NONFINITE, ranks=tuple(sorted(culprits)),
                   detail={"per_rank": culprits})


class NonfiniteCheck:
    """Registered (first): the step's non-finite values, found from the rows (which travel on such a step) before
    the gather -- it decides whether the step localises -- and narrowed after it, with every named rank's
    localisation, to the rank(s) where they began (trainguard.ranks.attribution.narrow_to_origin)."""

    def __init__(self, cfg, device=None):
        self.cfg = cfg

    def clear(self, step: int, s) -> bool:
        return not (s.bad or s.loss_bad)  # (no rank's loss or gradient was non-finite)

    def early(self, step: int, ctx: Decide) -> list[Verdict]:
        if ctx.summary.bad:
            ctx.nonfinite = detect_nonfinite(ctx.rows, scaled=ctx.scaled)
        return []

    def observe(self, step: int, ctx: Decide) -> list[Verdict]:
        if ctx.nonfinite is not None and ctx.everyone:
            ctx.nonfinite = narrow_to_origin(ctx.nonfinite, ctx.everyone, ctx.coords)
        return []


REGISTRATION = Registration(key="nonfinite", build=NonfiniteCheck, order=10)
