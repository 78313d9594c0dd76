"""The in-memory snapshot tier's DeepSpeed part (trainguard/checkpoint/memory_tier.py is the tier itself).

A snapshot is what ``save_checkpoint`` would write for *this rank alone*, taken without a collective:
DeepSpeed's own state dicts (module and engine state, the rank's ZeRO optimizer partition, scheduler,
loss scaler, steps) are built by its ``_save_checkpoint`` / ``_save_zero_checkpoint`` -- with every rank
keeping the module states, so that each shard loads on its own -- and copied to host memory (the
blocking part), with trainguard's sidecar (RNG, data position) and the guard's state. A shard loads
through DeepSpeed's own ``load_checkpoint`` from the rank's own folder (ds_plugins.checkpoint).

ZeRO stages 0-2 (under ZeRO-3 the module states are gathered: a collective), without MoE or pipeline engines.
"""
from __future__ import annotations

from pathlib import Path

from ds_plugins.engines import _Capture
from trainguard.ports import CORE_VERSION, host_copy

__all__ = ["DeepSpeedShard"]


class DeepSpeedShard:
    """trainguard.protocols.ShardSource over a DeepSpeed engine (``ds``: ds_plugins.checkpoint.DeepSpeedState)."""

    def __init__(self, ds):
        self.ds = ds

    def unsupported(self) -> str | None:
        eng = self.ds.engine
        if eng.zero_optimization_stage() > 2:
            return "ZeRO-3 gathers the module states to save them (a collective on the step)"
        if getattr(eng, "has_moe_layers", False):
            return "MoE engines save expert states per expert group"
        if hasattr(eng, "is_pipe_parallel") and eng.is_pipe_parallel:
            return "pipeline engines save their layers through the pipeline module"
        return None

    def estimated_bytes(self) -> int:
        return _estimated_shard_bytes(self.ds.engine)

    def step(self) -> int:
        return self.ds.engine.global_steps

    def capture(self, staging_root: Path, tag: str, step: int) -> list:
        eng = self.ds.engine
        capture = _Capture(eng.checkpoint_engine, host_copy)
        engine_before, eng.checkpoint_engine = eng.checkpoint_engine, capture
        writer_before, eng.save_non_zero_checkpoint = eng.save_non_zero_checkpoint, True  # each shard loads alone
        try:
            cs = {"trainguard": {"tag": tag, "step": step, "version": CORE_VERSION, "tier": "memory"}}
            eng._save_checkpoint(str(staging_root), tag, client_state=cs)  # (writes zero_to_fp32.py: node memory)
            if eng.save_zero_checkpoint:
                eng._save_zero_checkpoint(str(staging_root), tag)
        finally:
            eng.checkpoint_engine, eng.save_non_zero_checkpoint = engine_before, writer_before
        return [(state, Path(path)) for state, path in capture.writes]


def _estimated_shard_bytes(eng) -> int:
    """About what one rank's shard takes before the first one is written: the module states (every rank keeps them;
    ZeRO-3 its partition) and its optimizer partition (an fp32 master copy under bf16/fp16, Adam's two moments; ZeRO
    1-3). The first snapshot's record gives the real figure."""
    params = list(eng.module.parameters())
    n = sum(getattr(p, "ds_numel", p.numel()) for p in params)  # (ZeRO-3's partitioned parameters: their full size)
    dp, stage = max(1, eng.dp_world_size), eng.zero_optimization_stage()
    module = sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in params) / (dp if stage >= 3 else 1)
    per_element = 4 * (3 if eng.bfloat16_enabled() or eng.fp16_enabled() else 2)
    return int(module + (n / dp if stage >= 1 else n) * per_element)
