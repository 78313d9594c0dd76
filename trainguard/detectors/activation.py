"""Activation range (sampled): a module's output max-abs above ``max_abs`` is an alert; a
non-finite output is a non-finite verdict at once, with the module path and rank."""
from __future__ import annotations

import math

from trainguard.ranks.attribution import merge_nonfinite
from trainguard.config import ActivationRangeConfig
from trainguard.detectors.registry import Decide, Registration
from trainguard.verdicts import Verdict


def detect_activation(per_rank: dict[int, dict[str, tuple[float, float]]], cfg: ActivationRangeConfig) -> list[Verdict]:
    """``per_rank[rank][module] = (max_abs, rms)``, gathered on a sampled step."""
    nonfinite, large = {}, {}
    for rank, stats in sorted(per_rank.items()):
        for module, (max_abs, rms) in stats.items():
            if not math.isfinite(max_abs) or not math.isfinite(rms):
                nonfinite.setdefault(rank, module)  # modules arrive in execution order
            elif max_abs > cfg.max_abs:
                large.setdefault(rank, []).append({"module": module, "max_abs": max_abs, "rms": rms})
    out = []
    if nonfinite:
        out.append(Verdict("activation_range", "nonfinite", tuple(sorted(nonfinite)), {
            "per_rank": {r: {"origin": "activation", "first_nonfinite_module": m} for r, m in nonfinite.items()}}))
    if large:
        out.append(Verdict("activation_range", "activation_range", tuple(sorted(large)), {
            "max_abs_limit": cfg.max_abs,
            "per_rank": {r: sorted(v, key=lambda d: -d["max_abs"])[:5] for r, v in large.items()}}))
    return out


class ActivationRange:
    """Registered: on a sampled step, every rank's module output ranges (gathered); a non-finite output joins the
    step's non-finite finding."""

    def __init__(self, cfg: ActivationRangeConfig, device=None):
        self.cfg = cfg

    def clear(self, step: int, s) -> bool:
        return True  # (it finds only on a sampled probe's step, which is never a clear one: trainguard.step.evidence)

    def observe(self, step: int, ctx: Decide) -> list[Verdict]:
        if not ctx.everyone or ctx.probed.get("activation") is None:
            return []
        out = []
        for v in detect_activation({r: e["activation"] or {} for r, e in ctx.everyone.items()}, self.cfg):
            if v.anomaly == "nonfinite":
                ctx.nonfinite = merge_nonfinite(ctx.nonfinite, v)
            else:
                out.append(v)
        return out


REGISTRATION = Registration(key="activation_range", build=ActivationRange, order=30)
