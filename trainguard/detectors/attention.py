"""Attention entropy (sampled): a head whose entropy collapses toward 0 attends to a single token
(a known precursor of training instability); a head that had learnt to focus and is saturated again at log(keys)
attends uniformly -- it stopped attending. A head that never focused is no change: small models and short sequences
keep heads near uniform for their whole run (bench/natural/healthy.py: every healthy run alerted on it at a fixed
step 500 before)."""
from __future__ import annotations

from trainguard.config import AttentionEntropyConfig
from trainguard.detectors.registry import Decide, Registration
from trainguard.verdicts import Verdict


def detect_attention(step: int, per_rank: dict[int, dict[str, dict]], cfg: AttentionEntropyConfig,
                     focused: set | None = None) -> list[Verdict]:
    """``per_rank[rank][layer] = {"entropy": [per head, nats], "ratio": [per head, of the maximum]}``. ``focused``: the
    (rank, layer, head) that have been below ``cfg.focused_below`` at a sample (updated here); a saturated head counts
    only when it is one of them (None: every head counts)."""
    collapsed, saturated = [], []
    for rank, layers in sorted(per_rank.items()):
        for layer, v in layers.items():
            for head, (ent, ratio) in enumerate(zip(v["entropy"], v["ratio"])):
                item = {"rank": rank, "layer": layer, "head": head, "entropy": round(ent, 4),
                        "ratio": round(ratio, 4)}
                if ratio < cfg.collapse:
                    collapsed.append(item)
                elif step >= cfg.min_step and ratio > cfg.saturation and (focused is None or
                                                                         (rank, layer, head) in focused):
                    saturated.append(item)
                if focused is not None and ratio < cfg.focused_below:
                    focused.add((rank, layer, head))
    out = []
    if collapsed:
        out.append(Verdict("attention_entropy", "entropy_collapse", tuple(sorted({c["rank"] for c in collapsed})),
                           {"heads": collapsed, "limit_ratio": cfg.collapse}))
    if saturated:
        out.append(Verdict("attention_entropy", "entropy_saturation", tuple(sorted({c["rank"] for c in saturated})),
                           {"heads": saturated[:32], "count": len(saturated), "limit_ratio": cfg.saturation}))
    return out


class AttentionEntropy:
    """Registered: on a sampled step, every rank's attention heads' entropy (gathered)."""

    def __init__(self, cfg: AttentionEntropyConfig, device=None):
        self.cfg = cfg
        self.focused: set = set()  # the heads seen focused (the same on every rank: every rank's entropies gathered)

    def clear(self, step: int, s) -> bool:
        return True  # (it finds only on a sampled probe's step, which is never a clear one: trainguard.step.evidence)

    def observe(self, step: int, ctx: Decide) -> list[Verdict]:
        if not ctx.everyone or ctx.probed.get("entropy") is None:
            return []
        return detect_attention(step, {r: e["entropy"] or {} for r, e in ctx.everyone.items()}, self.cfg,
                                self.focused)


REGISTRATION = Registration(key="attention_entropy", build=AttentionEntropy, order=40)
