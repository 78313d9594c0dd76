"""Attention entropy (sampled): a head whose entropy collapses toward 0 attends to a single token
(a known precursor of training instability); a head saturated at log(keys) attends uniformly."""
from __future__ import annotations

from trainguard.config import AttentionEntropyConfig
from trainguard.detectors.registry import Decide, Registration
from trainguard.verdicts import Verdict


def detect_attention(step: int, per_rank: dict[int, dict[str, dict]], cfg: AttentionEntropyConfig) -> list[Verdict]:
    """``per_rank[rank][layer] = {"entropy": [per head, nats], "ratio": [per head, of the maximum]}``."""
    collapsed, saturated = [], []
    for rank, layers in sorted(per_rank.items()):
        for layer, v in layers.items():
            for head, (ent, ratio) in enumerate(zip(v["entropy"], v["ratio"])):
                item = {"rank": rank, "layer": layer, "head": head, "entropy": round(ent, 4),
                        "ratio": round(ratio, 4)}
                if ratio < cfg.collapse:
                    collapsed.append(item)
                elif step >= cfg.min_step and ratio > cfg.saturation:
                    saturated.append(item)
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

    def observe(self, step: int, ctx: Decide) -> list[Verdict]:
        if not ctx.everyone or ctx.probed.get("entropy") is None:
            return []
        return detect_attention(step, {r: e["entropy"] or {} for r, e in ctx.everyone.items()}, self.cfg)


REGISTRATION = Registration(key="attention_entropy", build=AttentionEntropy, order=40)
