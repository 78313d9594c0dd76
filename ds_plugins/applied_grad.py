"""The applied-gradient meter (trainguard.step.appliedgrad) on the torch optimizer inside DeepSpeed's: what the step
applied, after DeepSpeed's clipping."""
from __future__ import annotations

import torch
import torch.distributed as dist


def _applied_grad_meter(engine):
    """A meter on the torch optimizer DeepSpeed steps after clipping (ZeRO's inner optimizer over the
    fp32 partitions; at ZeRO-0 fp32 the optimizer itself, on the full reduced gradients)."""
    from trainguard.ports import AppliedGradMeter

    inner = engine.optimizer
    while isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer) and inner.optimizer is not inner:
        inner = inner.optimizer
    if not isinstance(inner, torch.optim.Optimizer):
        return None
    local = sum(p.numel() for g in inner.param_groups for p in g["params"])
    full = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters() if p.requires_grad)
    group = getattr(engine, "data_parallel_group", None)
    dp = dist.get_world_size(group) if dist.is_initialized() else 1
    # a partition (ZeRO >= 1) is held once; full gradients (ZeRO-0) by every data-parallel rank
    replication = max(1, round(local * dp / full)) if full else 1
    return AppliedGradMeter([inner], replication=replication)

