"""What a DeepSpeed engine tells the session at the start (ds_plugins.engine.EngineGuard): the rank's coordinates,
the run_start record's framework facts, the run's facts for the start-of-run checks (trainguard.prevent.checks.RunFacts),
its precision, the device of the AGREE table, and where DeepSpeed reduces the local gradients."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

import ds_plugins
from trainguard.ports import collective_device, gather_coords, RunFacts, UNTAGGED
from trainguard.config import TrainguardConfig


def _coords(eng, rank: int):
    mpu = getattr(eng, "mpu", None)
    tp = mpu.get_model_parallel_rank() if mpu is not None and hasattr(mpu, "get_model_parallel_rank") else 0
    pp = mpu.get_pipeline_model_parallel_rank() if mpu is not None and hasattr(
        mpu, "get_pipeline_model_parallel_rank") else 0
    dp = dist.get_rank(eng.data_parallel_group) if dist.is_initialized() and getattr(
        eng, "data_parallel_group", None) is not None else rank
    return gather_coords(dp=dp, tp=tp, pp=pp, local_rank=int(os.environ.get("LOCAL_RANK", 0)))


def _dtype(eng) -> str:
    return "fp16" if eng.fp16_enabled() else "bf16" if eng.bfloat16_enabled() else "fp32"


def _framework_facts(eng, cfg: TrainguardConfig) -> dict:
    import deepspeed

    return {"framework": "deepspeed", "deepspeed": deepspeed.__version__, "torch": torch.__version__,
            "zero_stage": eng.zero_optimization_stage(), "dtype": _dtype(eng),
            "optimizer": type(eng.optimizer).__name__,
            "gradient_accumulation_steps": eng.gradient_accumulation_steps(),
            "micro_batch_per_rank": eng.train_micro_batch_size_per_gpu(),
            "clipping": {"mode": cfg.clipping.mode, "deepspeed_gradient_clipping": eng.gradient_clipping()},
            "untagged_loaders": list(UNTAGGED), "releases": dict(ds_plugins.RELEASES["checked"]),
            "untested_releases": list(ds_plugins.RELEASES["untested"])}


def _run_facts(eng, client_scheduler) -> RunFacts:
    """(The run's length, where its schedule was told it: no loop over DeepSpeed rewinds its data with a rollback --
    HF's and Accelerate's count goes on, and your ``for batch in loader`` ends where the loader does.)"""
    from trainguard.ports import bf16_supported

    bf16 = bf16_supported()
    sched_cfg = eng.config.get("scheduler") if isinstance(getattr(eng, "config", None), dict) else None
    warmup: int | None = None
    name = None
    if sched_cfg:
        name = sched_cfg.get("type")
        params = sched_cfg.get("params", {})
        if "warmup_num_steps" in params:
            warmup = int(params["warmup_num_steps"])
        elif name in ("OneCycle",):
            warmup = int(params.get("cycle_first_step_size", 0))
        else:
            warmup = -1
    elif client_scheduler is not None:
        name = client_scheduler if isinstance(client_scheduler, str) else type(client_scheduler).__name__
        warmup = -1
    return RunFacts(dtype=_dtype(eng), bf16_supported=bf16, warmup_steps=warmup, scheduler=name,
                    framework_clip=float(eng.gradient_clipping() or 0.0),
                    last_step=_last_step(eng, sched_cfg))


def _last_step(eng, sched_cfg: dict | None) -> int | None:
    """The run's length as its schedule was told it: DeepSpeed's ``total_num_steps`` (HF's Trainer fills it), or
    transformers' schedules' ``num_training_steps`` (a LambdaLR over a partial); None: not said."""
    lambdas = getattr(eng.lr_scheduler, "lr_lambdas", None) or [None]
    total = ((sched_cfg or {}).get("params") or {}).get("total_num_steps",
                                                         getattr(lambdas[0], "keywords", {}).get("num_training_steps"))
    return int(total) if isinstance(total, int) and total > 0 else None  # (not "auto" left unfilled)


def _collective_device() -> torch.device:
    """Where the AGREE tensor must live (trainguard.ranks.isolation.collective_device), with DeepSpeed's
    accelerator as the device of any other backend."""
    try:
        from deepspeed.accelerator import get_accelerator

        name = get_accelerator().current_device_name()
    except Exception:  # noqa: BLE001
        name = None
    return collective_device(name)


def _reduction_points(engine) -> tuple[list, float | None]:
    """Where this engine reduces the local gradients (trainguard.step.gradhooks ``at_reduction``), and the divisor of
    the norms seen there: ZeRO-0 all at the boundary, accumulated (1); ZeRO-1/2 each contiguous bucket, ZeRO-1's
    accumulated, ZeRO-2's every micro-batch's (None: the accumulation steps'). None (hooks): ZeRO-3, unknown internals,
    sparse gradients (passed as DeepSpeed's own wrapper) and CPU offload (its reduction stream waits on the bucket's
    fill events only, not on a norm queued after them)."""
    stage, opt = engine.zero_optimization_stage(), engine.optimizer
    if getattr(engine, "sparse_gradients_enabled", lambda: False)() or getattr(opt, "cpu_offload", False):
        return [], None
    if stage == 0 and hasattr(engine, "_reduce_non_expert_gradients"):
        return [(engine, "_reduce_non_expert_gradients", lambda grads, *a, **k: grads), (
            engine, "_reduce_expert_gradients", lambda grads, *a, **k: [g for gs in grads.values() for g in gs])], 1.0
    if stage in (1, 2) and getattr(opt, "contiguous_gradients", False) and hasattr(opt, "average_tensor"):
        return [(opt, "average_tensor", lambda tensor, *a, **k: (tensor,))], 1.0 if stage == 1 else None
    return [], None
