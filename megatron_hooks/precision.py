"""The fp16 -> bf16 fallback on megatron-core: the same model, DDP and optimizer objects, in bf16.

The last rung of the ``loss_scale`` ladder (the adapter has just rolled back, or has no snapshot to
roll back to). megatron-core builds an fp16 run as ``DistributedDataParallel(Float16Module(model))``
and a ``Float16OptimizerWithFloat16Params`` holding fp32 main copies of every parameter and a
``DynamicGradScaler``. This module turns that stack into the one megatron builds for ``--bf16``,
in place, so that the user's ``model`` list, ``optimizer`` and LR scheduler objects carry on:

1. the configs: ``TransformerConfig`` fp16 -> bf16 (and ``params_dtype`` / ``pipeline_dtype``
   where they were fp16), the ``OptimizerConfig`` likewise;
2. the model: ``Float16Module`` casts its module to bf16 and converts inputs with ``bfloat16()``;
   every ``FusedScaleMaskSoftmax`` returns bf16 probabilities (they fix fp16/bf16 at construction);
3. ``DistributedDataParallel``: its gradient buffers (fp16) and its gradient-accumulation hooks
   are per dtype, so a new DDP is built over the same ``Float16Module`` (the same arguments: the
   DDP config, bucketing) and the user's DDP object is given its ``__dict__`` -- the same object,
   the same class. (Changing a parameter's dtype gives it a new gradient accumulator, so the old
   DDP's hooks no longer fire; tensor hooks on the parameters -- the guard's -- survive.)
4. the optimizer keeps its fp32 main parameters and their Adam state (nothing is lost: those are
   the exact values), drops its grad scaler (megatron's bf16 runs have none), and writes the main
   parameters into the now-bf16 model parameters. The *distributed* optimizer is built from the
   DDP's buffers, so it is built again (``get_megatron_optimizer`` with the bf16 config, over the
   new DDP); each rank's shard of the main parameters and their Adam state is staged through host
   memory (the old optimizer's device memory freed first) and written into the new one, parameter
   by parameter; the user's optimizer object is given its ``__dict__``; the parameters are then
   all-gathered as after a step.

Not covered (:class:`FallbackUnavailable`, the ladder then aborts with its report): FP32 or
other optimizer classes, megatron FSDP, the precision-aware optimizer, a distributed optimizer
whose parameter groups ``get_megatron_optimizer`` does not rebuild as they were (custom
``config_overrides``), a DDP built with a custom ``pg_collection``, and model chunks that are not
``DistributedDataParallel(Float16Module(...))``.
"""
from __future__ import annotations

import torch

from trainguard.errors import FallbackUnavailable

from megatron_hooks import _optimizers



def check(chunks, optimizer) -> None:
    """Raise :class:`FallbackUnavailable` unless :func:`fallback_to_bf16` can convert this stack.
    Touches nothing."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params
    from megatron.core.transformer.module import Float16Module

    for o in _optimizers(optimizer):
        if type(o) not in (Float16OptimizerWithFloat16Params, DistributedOptimizer):
            raise FallbackUnavailable(f"{type(o).__name__} is not covered (megatron's fp16 optimizers are: "
                                      "Float16OptimizerWithFloat16Params, DistributedOptimizer)")
        if not o.config.fp16:
            raise FallbackUnavailable("the optimizer is not an fp16 one")
        if isinstance(o, DistributedOptimizer) and (o.ddp_config.use_megatron_fsdp or
                                                    o.config.use_precision_aware_optimizer):
            raise FallbackUnavailable("megatron FSDP and the precision-aware optimizer are not covered")
    for i, chunk in enumerate(chunks):
        if not isinstance(chunk, DistributedDataParallel) or not isinstance(chunk.module, Float16Module):
            raise FallbackUnavailable(f"model chunk {i} is {type(chunk).__name__}, not "
                                      "DistributedDataParallel(Float16Module(...))")
        if chunk.dp_group is not ps.get_data_parallel_group(with_context_parallel=False) or \
                chunk.tp_group is not ps.get_tensor_model_parallel_group():
            raise FallbackUnavailable(f"model chunk {i}'s DDP was built with a custom pg_collection")


def _to_bf16(dtype):
    return torch.bfloat16 if dtype == torch.float16 else dtype


def fallback_to_bf16(chunks, optimizer) -> dict:
    """Convert the fp16 stack to bf16 in place (see the module's docstring). Returns what it did."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax

    check(chunks, optimizer)
    distributed = chunks[0].ddp_config.use_distributed_optimizer
    staged = [_stage_to_host(o) for o in _optimizers(optimizer)] if distributed else None
    configs = {id(c.config): c.config for c in chunks} | {id(c.module.config): c.module.config for c in chunks}
    for cfg in configs.values():
        cfg.fp16, cfg.bf16 = False, True
        cfg.params_dtype = _to_bf16(cfg.params_dtype)
        cfg.pipeline_dtype = _to_bf16(cfg.pipeline_dtype)
    softmaxes = 0
    for chunk in chunks:
        f16 = chunk.module
        f16.fp16, f16.bf16 = False, True
        f16.float16_convertor = _bfloat16
        f16.module.bfloat16()  # (the same Parameter objects, their data now bf16)
        for m in f16.module.modules():
            if isinstance(m, FusedScaleMaskSoftmax) and m.input_in_fp16:
                m.input_in_fp16, m.input_in_bf16 = False, True
                softmaxes += 1
    for chunk in chunks:
        disable_bucketing = chunk.bucket_size is None and chunk.ddp_config.bucket_size is not None and \
            _pp_rank(chunk) == 0
        new = DistributedDataParallel(chunk.config, chunk.ddp_config, chunk.module, disable_bucketing=disable_bucketing)
        object.__setattr__(chunk, "__dict__", new.__dict__)  # the user's DDP object is the new one
    if distributed:
        return _rebuild_distributed(chunks, optimizer, staged, softmaxes)
    carried = 0
    outer = getattr(optimizer, "config", None)
    if outer is not None:
        outer.fp16, outer.bf16 = False, True
    for o in _optimizers(optimizer):
        o.config.fp16, o.config.bf16 = False, True
        o.grad_scaler = None
        o._scale_one = torch.tensor([1.0], dtype=torch.float, device=_device(o))
        o._dummy_overflow_buf = None
        o._copy_main_params_to_model_params()  # the exact fp32 values, rounded to bf16
        carried += sum(len(g) for g in o.fp32_from_float16_groups)
    return {"optimizer_state": "carried", "main_params": carried, "softmax_modules": softmaxes,
            "optimizer": type(_optimizers(optimizer)[0]).__name__,
            "note": "the fp32 main parameters and the optimizer state carried over; the grad scaler dropped"}


def _bfloat16(val):
    return val.bfloat16()


def _pp_rank(chunk) -> int:
    pp = chunk.pp_group[0] if isinstance(chunk.pp_group, list) else chunk.pp_group
    return pp.rank()


def _device(optimizer):
    for group in optimizer.fp32_from_float16_groups:
        for p in group:
            return p.device
    return "cpu"


def _stage_to_host(o) -> dict:
    """A distributed optimizer's state on this rank -- per model parameter with a shard here, the
    fp32 main shard and its Adam state -- copied to host memory; the device copies are freed."""
    staged = {"hyper": [{k: v for k, v in g.items() if k != "params"} for g in o.optimizer.param_groups],
              "index": dict(o.model_param_group_index_map), "tensors": {}}
    for p in o.model_param_group_index_map:
        staged["tensors"][p] = {k: v.detach().to("cpu", copy=True)
                                for k, v in o._get_main_param_and_optimizer_states(p).items()}
    o.optimizer.state.clear()
    for group in o.optimizer.param_groups:
        for main in group["params"]:
            main.data = torch.empty(0, dtype=main.dtype, device=main.device)
    return staged


def _rebuild_distributed(chunks, optimizer, staged: list, softmaxes: int) -> dict:
    """The bf16 distributed optimizer over the new DDP buffers, given the staged state."""
    import dataclasses

    from megatron.core.optimizer import get_megatron_optimizer

    olds = _optimizers(optimizer)
    config = dataclasses.replace(olds[0].config, fp16=False, bf16=True)
    new = get_megatron_optimizer(config, chunks)
    news = _optimizers(new)
    if len(news) != len(olds) or any(type(a) is not type(b) for a, b in zip(olds, news)):
        raise FallbackUnavailable(f"get_megatron_optimizer built {[type(o).__name__ for o in news]} where the run had "
                                  f"{[type(o).__name__ for o in olds]}")
    carried = 0
    for o, st in zip(news, staged):
        if dict(o.model_param_group_index_map) != st["index"] or len(o.optimizer.param_groups) != len(st["hyper"]):
            raise FallbackUnavailable("the rebuilt distributed optimizer groups the parameters differently (custom "
                                      "config_overrides?)")
        o._init_optimizer_states_with_dummy_values()  # (megatron's own: the state the carried one is written into)
        for p, tensors in st["tensors"].items():
            dst = o._get_main_param_and_optimizer_states(p)
            # (an optimizer that never stepped -- a resume, whose load follows -- has main params only)
            if not set(tensors) <= set(dst) or any(dst[k].shape != v.shape for k, v in tensors.items()):
                raise FallbackUnavailable("the rebuilt distributed optimizer shards a parameter differently")
            for k, v in tensors.items():
                dst[k].data.copy_(v)
            carried += 1
        for group, hyper in zip(o.optimizer.param_groups, st["hyper"]):
            group.update(hyper)  # the LR and weight decay the scheduler set, the group's step count
        o._copy_main_params_to_model_params()  # this rank's shard of the bf16 parameters ...
    for chunk in chunks:
        chunk.start_param_sync(force_sync=True)  # ... and everyone's, as after a step
    object.__setattr__(optimizer, "__dict__", new.__dict__)  # the user's optimizer object is the new one
    return {"optimizer_state": "carried", "main_params": carried, "softmax_modules": softmaxes,
            "optimizer": type(news[0]).__name__,
            "note": "the distributed optimizer rebuilt over the bf16 buffers; each rank's fp32 main shards and their "
                    "optimizer state carried over (staged through host memory); the grad scaler dropped"}
