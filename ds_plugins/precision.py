"""The fp16 -> bf16 fallback: re-create the engine in bf16, in place, from the rolled-back state.

The last rung of the ``loss_scale`` ladder. The adapter has just rolled the fp16 engine back; this
module then

1. reads the full fp32 master weights (DeepSpeed's ``safe_get_full_fp32_param`` at ZeRO 1/2, the
   flat fp32 groups of ZeRO-0's FP16_Optimizer), and the optimizer's flat fp32 partitions and
   their Adam state when the bf16 engine will use the *same* optimizer class (ZeRO 1/2: both are
   ``DeepSpeedZeroOptimizer``, partitioned identically) -- otherwise the optimizer starts fresh
   and the event says so;
2. retires the fp16 engine (its optimizer's hooks and its module hooks removed);
3. builds a bf16 engine with ``deepspeed.initialize`` from the config and the optimizer/scheduler
   recipe recorded at ``ds_plugins.initialize`` (the same module object);
4. writes the fp32 state into it, and the step counters and LR-scheduler state;
5. makes the user's engine object *be* the new engine (they share one ``__dict__``), so the
   user's ``engine`` variable -- and their ``for batch in loader`` loop -- carry on.

What cannot carry on: references the user kept to the *optimizer* or *scheduler* objects that
initialize returned (use ``engine.optimizer`` / ``engine.lr_scheduler``), ZeRO-3 (its parameters
are already partitioned into the old engine), and a scheduler *object* passed to initialize (it
is bound to the old optimizer; pass a callable or configure it in the DeepSpeed config).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch

from trainguard.errors import FallbackUnavailable



@dataclass
class Recipe:
    """How ``ds_plugins.initialize`` built the engine, kept to build it again."""

    config: dict
    optimizer: Callable | None          # params -> optimizer; None: DeepSpeed builds it from the config
    lr_scheduler: Any = None            # None or a callable (a scheduler object cannot be rebuilt)
    mpu: Any = None
    why_not: str | None = None          # set when the engine cannot be rebuilt


def recipe_for(config: dict, optimizer, lr_scheduler, mpu) -> Recipe:
    why_not = None
    opt_factory = None
    if isinstance(optimizer, torch.optim.Optimizer):
        # DeepSpeed rewrites the param groups of the optimizer it wraps: remember them now
        import inspect

        cls = type(optimizer)
        accepted = inspect.signature(cls.__init__).parameters
        # (defaults may hold keys the constructor does not take, e.g. AdamW's decoupled_weight_decay;
        # the groups below carry every value anyway)
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        groups = [{k: v for k, v in g.items() if k != "params"} | {"params": list(g["params"])}
                  for g in optimizer.param_groups]

        def opt_factory(_params, cls=cls, defaults=defaults, groups=groups):
            return cls([dict(g, params=list(g["params"])) for g in groups], **defaults)
    elif callable(optimizer):
        opt_factory = optimizer
    if lr_scheduler is not None and not callable(lr_scheduler):
        why_not = ("lr_scheduler was passed as an object, bound to the fp16 engine's optimizer; pass a callable "
                   "(optimizer -> scheduler) or configure the scheduler in the DeepSpeed config")
    elif hasattr(lr_scheduler, "step") and hasattr(lr_scheduler, "state_dict"):
        why_not = "lr_scheduler was passed as an object; pass a callable or use the DeepSpeed config's scheduler"
    return Recipe(copy.deepcopy(config), opt_factory, lr_scheduler, mpu, why_not)


def _fp32_weights(engine, params) -> list[torch.Tensor]:
    """Full fp32 values of ``params``: the optimizer's master copy where DeepSpeed keeps one."""
    from deepspeed.utils import safe_get_full_fp32_param

    opt = engine.optimizer
    flat = getattr(opt, "fp32_groups_flat", None)
    by_id: dict[int, torch.Tensor] = {}
    if flat and getattr(opt, "fp16_groups", None):  # ZeRO-0 FP16_Optimizer
        from torch._utils import _unflatten_dense_tensors

        for f, group in zip(flat, opt.fp16_groups):
            for p, v in zip(group, _unflatten_dense_tensors(f.detach(), group)):
                by_id[id(p)] = v.float().clone()
    out = []
    for p in params:  # the same order on every rank: safe_get_full_fp32_param is collective at ZeRO 1/2
        v = by_id.get(id(p))
        if v is None:
            v = safe_get_full_fp32_param(p)
        out.append((v if v is not None else p.detach()).float().cpu().clone())
    return out


def _zero_partitions(engine) -> list[tuple[torch.Tensor, dict]] | None:
    opt = engine.optimizer
    parts = getattr(opt, "single_partition_of_fp32_groups", None)
    if type(opt).__name__ != "DeepSpeedZeroOptimizer" or not parts:
        return None
    inner = opt.optimizer
    return [(t.detach().clone(), {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                                  for k, v in inner.state.get(t, {}).items()}) for t in parts]


def _retire(engine) -> None:
    opt = engine.optimizer
    if hasattr(opt, "destroy"):
        opt.destroy()  # removes its gradient hooks from the (shared) parameters
    for name in ("module_forward_pre_hook", "module_forward_post_hook", "first_dataloader_check"):
        h = getattr(engine, name, None)
        if h is not None:
            h.remove()
            setattr(engine, name, None)


def fallback_to_bf16(engine, recipe: Recipe | None) -> dict:
    """Rebuild ``engine`` (the user's object) in bf16 in place. Returns what was carried over."""
    import deepspeed
    from deepspeed.utils import safe_set_full_fp32_param

    if recipe is None:
        raise FallbackUnavailable("the engine was not built by ds_plugins.initialize, so it cannot be rebuilt")
    if recipe.why_not:
        raise FallbackUnavailable(recipe.why_not)
    if engine.zero_optimization_stage() == 3:
        raise FallbackUnavailable("ZeRO-3 partitions the parameters into the fp16 engine; restart the run with "
                                  "bf16 from the checkpoint instead")
    module = engine.module
    params = list(module.parameters())
    weights = _fp32_weights(engine, params)
    partitions = _zero_partitions(engine)
    counters = {k: getattr(engine, k) for k in ("global_steps", "global_samples", "skipped_steps", "micro_steps")}
    sched = engine.lr_scheduler
    sched_state = sched.state_dict() if sched is not None and hasattr(sched, "state_dict") else None
    _retire(engine)

    cfg = copy.deepcopy(recipe.config)
    cfg.pop("fp16", None)
    cfg.pop("bfloat16", None)
    cfg["bf16"] = {"enabled": True}
    with torch.no_grad():
        for p, w in zip(params, weights):
            p.data = w.to(p.device)  # fp32: the new engine casts to bf16 from the exact values
    trainable = [p for p in params if p.requires_grad]
    new, _, _, _ = deepspeed.initialize(
        model=module, optimizer=recipe.optimizer(trainable) if recipe.optimizer else None,
        model_parameters=trainable, lr_scheduler=recipe.lr_scheduler, mpu=recipe.mpu, config=cfg,
        dist_init_required=False)

    carried = "fresh"
    new_parts = _zero_partitions(new)
    if partitions is not None and new_parts is not None and \
            [t.shape for t, _ in partitions] == [t.shape for t, _ in new_parts]:
        inner = new.optimizer.optimizer
        for (old_t, state), tgt in zip(partitions, new.optimizer.single_partition_of_fp32_groups):
            tgt.data.copy_(old_t)
            if state:
                inner.state[tgt] = state
        carried = "carried"
    with torch.no_grad():
        for p, w in zip(params, weights):
            safe_set_full_fp32_param(p, w.to(p.device))  # no-op where the master copy was carried
            p.data.copy_(w.to(p.device, p.dtype))
    for k, v in counters.items():
        setattr(new, k, v)
    if sched_state is not None and new.lr_scheduler is not None and hasattr(new.lr_scheduler, "load_state_dict"):
        new.lr_scheduler.load_state_dict(sched_state)

    # the user's object becomes the new engine: one shared __dict__, the guarded class of the new one
    object.__setattr__(engine, "__dict__", new.__dict__)
    return {"optimizer_state": carried, "zero_stage": new.zero_optimization_stage(),
            "optimizer": type(new.optimizer).__name__,
            "note": None if carried == "carried" else
            "the fp16 and bf16 optimizers differ at this ZeRO stage: weights carried over, optimizer state fresh"}
