"""The megatron-core objects the adapter reads: the model chunks and their modules, the optimizers a megatron
optimizer is made of, its fp16 grad scaler, the chunks' precision."""
from __future__ import annotations

from typing import Sequence

import torch


def _optimizers(optimizer) -> list:
    """The optimizers a megatron optimizer is made of: a ChainedOptimizer's, else itself."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module") and isinstance(chunk.module, torch.nn.Module):
        chunk = chunk.module
    return chunk


def _modules(chunks: Sequence[torch.nn.Module]) -> list[tuple[str, torch.nn.Module, int | None]]:
    """Every module of the model chunks with its path and, inside the decoder's layers, its global layer number
    across pipeline stages (``TransformerLayer.layer_number``): what the localisation flags name."""
    out = []
    for ci, chunk in enumerate(chunks):
        layer = None
        for name, m in _unwrap(chunk).named_modules():
            if not name:
                continue
            layer_number = getattr(m, "layer_number", None)
            if isinstance(layer_number, int) and type(m).__name__ == "TransformerLayer":
                layer = layer_number
            out.append((f"{ci}.{name}" if len(chunks) > 1 else name, m,
                        layer if name.startswith("decoder.layers.") else None))
    return out


class _GradScaler:
    """megatron's ``DynamicGradScaler`` (of a MixedPrecisionOptimizer, or the first of a chained
    one), read and adjusted in one place. It clamps at its minimum scale silently and skips every
    step from then on: the guard's loss-scale watch is what notices."""

    def __init__(self, optimizer):
        opts = _optimizers(optimizer)
        self.scalers = [o.grad_scaler for o in opts if getattr(o, "grad_scaler", None) is not None
                        and hasattr(o.grad_scaler, "min_scale")]
        cfg = getattr(opts[0], "config", None)
        self.initial = float(getattr(cfg, "initial_loss_scale", None) or 2.0 ** 32)
        self.last_scale = 1.0

    def active(self) -> bool:
        return bool(self.scalers)

    def state(self):
        from trainguard.ports import ScalerState

        g = self.scalers[0]
        self.last_scale = float(g.scale)  # (one host read)
        return ScalerState(self.last_scale, float(g.min_scale), int(g._hysteresis_tracker))

    def reset(self) -> dict:
        before = float(self.scalers[0].scale)
        for g in self.scalers:
            start = max(self.initial, float(g.min_scale))
            g._scale = torch.full_like(g._scale, start)
            g._hysteresis_tracker, g._growth_tracker = g.hysteresis, 0
        return {"scale_before": before, "scale_after": float(self.scalers[0].scale)}

    def raise_floor(self, factor: float) -> dict:
        old = float(self.scalers[0].min_scale)
        for g in self.scalers:
            g.min_scale = g.min_scale * factor
        return {"min_scale_before": old, "min_scale_after": old * factor}


def _dtype(chunk: torch.nn.Module) -> str:
    p = next(_unwrap(chunk).parameters(), None)
    if p is None:
        return "fp32"
    return {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(p.dtype, "fp32")
