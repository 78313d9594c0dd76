"""The DeepSpeed engine, guarded: the user's loop is unchanged, the guard runs inside it.

``attach`` swaps the engine's class for a subclass (``isinstance(engine, DeepSpeedEngine)`` still
holds) whose ``forward``, ``backward`` and ``step`` call the guard's loop points around
DeepSpeed's own, and registers one tensor hook per parameter. Tensor hooks fire with the local
gradient *before* it is accumulated into ``.grad``, i.e. before DeepSpeed's data-parallel
reduction at every ZeRO stage (ZeRO-0/1 reduce after backward, ZeRO-2 in its accumulate hooks,
ZeRO-3 in its reduce-scatter hooks): the non-finite check therefore sees each rank's own values at
every stage, and names the rank that produced them.
"""
from __future__ import annotations

import math
import os
from typing import Any

import torch
import torch.distributed as dist

from ds_plugins.skip import find_strategy, forced_skip
from trainguard.config import TrainguardConfig
from trainguard.events import Action
from trainguard.faults import FaultInjector
from trainguard.guard import StepGuard
from trainguard.isolation import gather_coords

_GUARDED_CLASSES: dict[type, type] = {}


def _loss_scale(engine) -> float:
    """The fp16 dynamic loss scale (1.0 when there is none). Host floats: no device sync."""
    if not engine.fp16_enabled():
        return 1.0
    opt = engine.optimizer
    for obj in (opt, getattr(opt, "loss_scaler", None), getattr(opt, "loss_scale_config", None)):
        value = getattr(obj, "cur_scale", None)
        if isinstance(value, (int, float)):
            return float(value)
    return 1.0


def _grad_norm(engine) -> float | None:
    """DeepSpeed's global (post-reduction) gradient norm of the last step, as a float.

    None where DeepSpeed does not compute one (ZeRO-0 fp32 with a torch optimizer)."""
    value = engine.get_global_grad_norm()
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        value = value.item()
    return float(value)


def _lr(engine) -> float | None:
    try:
        lrs = engine.get_lr()
    except Exception:  # noqa: BLE001 - some optimizers have no param_groups view
        return None
    return float(lrs[0]) if lrs else None


def _guarded_class(base: type) -> type:
    if base in _GUARDED_CLASSES:
        return _GUARDED_CLASSES[base]

    class Guarded(base):  # type: ignore[misc, valid-type]
        """DeepSpeed engine with trainguard's loop points (see trainguard.events.Event)."""

        def forward(self, *inputs, **kwargs):
            tg = self._trainguard
            step = self.global_steps + 1
            if tg.faults is not None:
                (inputs, kwargs), poison_output = tg.faults_batch(step, (inputs, kwargs))
                if poison_output:
                    with tg.poison_first_module():
                        return super().forward(*inputs, **kwargs)
            return super().forward(*inputs, **kwargs)

        def backward(self, loss, *args, **kwargs):
            tg = self._trainguard
            loss = tg.on_loss(self.global_steps + 1, loss)
            return super().backward(loss, *args, **kwargs)

        def step(self, *args, **kwargs):
            tg = self._trainguard
            if not self.is_gradient_accumulation_boundary():
                return super().step(*args, **kwargs)
            return tg.guarded_step(lambda: base.step(self, *args, **kwargs))

        def destroy(self, *args, **kwargs):
            self._trainguard.close()
            return super().destroy(*args, **kwargs)

    Guarded.__name__ = Guarded.__qualname__ = f"Trainguard{base.__name__}"
    _GUARDED_CLASSES[base] = Guarded
    return Guarded


class _PoisonFirstModule:
    """nan_batch on an integer-only batch: NaN in the output of the first leaf module that runs."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.handles: list = []
        self.done = False

    def __enter__(self):
        def hook(mod, args, output):
            if self.done or not isinstance(output, torch.Tensor) or not output.is_floating_point():
                return None
            self.done = True
            return output + float("nan")

        for m in self.module.modules():
            if not list(m.children()):
                self.handles.append(m.register_forward_hook(hook))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        return False


class EngineGuard:
    """The adapter's state on one rank: the core guard plus what only DeepSpeed knows."""

    def __init__(self, engine, cfg: TrainguardConfig, guard_enabled: bool = True):
        self.engine = engine
        self.cfg = cfg
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.guard: StepGuard | None = None
        self.faults: FaultInjector | None = None
        self._hooks: list = []
        self._closed = False
        if guard_enabled:
            if cfg.detectors.nonfinite.enabled:
                find_strategy(engine.optimizer)  # refuse an unsupported optimizer now, not at step time
            self.guard = StepGuard(cfg, self.rank, self.world, group=None, device=_collective_device())
            self.faults = self.guard.faults if cfg.faults else None  # one injector, owned by the guard
        elif cfg.faults:
            self.faults = FaultInjector(cfg.faults, self.rank)
        self._install_grad_hooks()
        if self.guard is not None:
            self.guard.on_begin(self._coords(), self._framework_facts())

    # ------------------------------------------------------------------ setup
    def _coords(self):
        eng = self.engine
        mpu = getattr(eng, "mpu", None)
        tp = mpu.get_model_parallel_rank() if mpu is not None and hasattr(mpu, "get_model_parallel_rank") else 0
        pp = mpu.get_pipeline_model_parallel_rank() if mpu is not None and hasattr(
            mpu, "get_pipeline_model_parallel_rank") else 0
        dp = dist.get_rank(eng.data_parallel_group) if dist.is_initialized() and getattr(
            eng, "data_parallel_group", None) is not None else self.rank
        return gather_coords(dp=dp, tp=tp, pp=pp, local_rank=int(os.environ.get("LOCAL_RANK", 0)))

    def _framework_facts(self) -> dict:
        eng = self.engine
        import deepspeed

        dtype = "fp16" if eng.fp16_enabled() else "bf16" if eng.bfloat16_enabled() else "fp32"
        return {"framework": "deepspeed", "deepspeed": deepspeed.__version__, "torch": torch.__version__,
                "zero_stage": eng.zero_optimization_stage(), "dtype": dtype,
                "optimizer": type(eng.optimizer).__name__,
                "grad_check_point": "local, before the data-parallel reduction (tensor hooks)",
                "gradient_accumulation_steps": eng.gradient_accumulation_steps(),
                "micro_batch_per_rank": eng.train_micro_batch_size_per_gpu()}

    def _install_grad_hooks(self) -> None:
        named = [(n, p) for n, p in self.engine.module.named_parameters() if p.requires_grad]
        targets = self.faults.grad_targets([n for n, _ in named]) if self.faults else {}
        check = self.guard is not None and self.cfg.detectors.nonfinite.enabled and \
            self.cfg.detectors.nonfinite.check_grads
        for name, p in named:
            specs = targets.get(name)
            if specs:  # the fault first, so the check sees what it did
                self._hooks.append(p.register_hook(
                    lambda g, specs=specs: self.faults.grad(self.engine.global_steps + 1, specs, g)))
            if check:
                self._hooks.append(p.register_hook(self._on_grad))

    def _on_grad(self, grad):
        self.guard.on_backward(grad)
        return None

    # ------------------------------------------------------------------ loop points
    def faults_batch(self, step: int, inputs):
        return self.faults.batch(step, inputs)

    def poison_first_module(self):
        return _PoisonFirstModule(self.engine.module)

    def on_batch(self, sample_ids, position) -> None:
        if self.guard is not None:
            self.guard.on_batch(sample_ids, position)

    def on_loss(self, step: int, loss):
        if self.guard is not None:
            return self.guard.on_loss(step, loss)
        if self.faults is not None:
            return self.faults.loss(step, loss)
        return loss

    def guarded_step(self, ds_step):
        eng, guard = self.engine, self.guard
        if guard is None:  # faults only (demo's plain-DeepSpeed comparison)
            return ds_step()
        step = eng.global_steps + 1
        obs = guard.on_agree(step, loss_scale=_loss_scale(eng), grad_divisor=eng.gradient_accumulation_steps())
        decision = guard.on_decide(step, obs)
        if decision.action is Action.ABORT:
            raise guard.abort(step, decision)
        own_norm = None
        if decision.action is Action.SKIP_STEP:
            with forced_skip(eng.optimizer):
                result = ds_step()
        else:
            if self._ds_has_no_norm():
                # ZeRO-0 fp32 with a torch optimizer: DeepSpeed computes no global norm. The reduced
                # gradients are in .grad until the step clears them; take the norm now, read it later.
                grads = [p.grad for p in eng.module.parameters() if p.grad is not None]
                own_norm = torch.nn.utils.get_total_norm(grads) if grads else None
            result = ds_step()
        applied = eng.was_step_applied()
        guard.on_step(step, decision, applied)
        grad_norm = _grad_norm(eng) if applied else None
        if grad_norm is None and applied and own_norm is not None:
            grad_norm = float(own_norm)
        guard.on_end(step, obs, {
            "grad_norm": grad_norm if grad_norm is None or math.isfinite(grad_norm) else None,
            "lr": _lr(eng), "loss_scale": _loss_scale(eng), "skipped_steps": eng.skipped_steps,
            "applied": applied, "action": decision.action.value})
        return result

    def _ds_has_no_norm(self) -> bool:
        eng = self.engine
        return not (eng.zero_optimization() or eng.bfloat16_enabled() or eng.fp16_enabled())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self.guard is not None:
            self.guard.on_close({"deepspeed_skipped_steps": self.engine.skipped_steps,
                                 "global_steps": self.engine.global_steps})


def _collective_device() -> torch.device:
    """Where the AGREE tensor must live for the default group's backend."""
    if dist.is_initialized() and dist.get_backend() == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    try:
        from deepspeed.accelerator import get_accelerator

        name = get_accelerator().current_device_name()
        if dist.is_initialized() and dist.get_backend() in ("gloo", "ccl"):
            return torch.device("cpu")
        return torch.device(name)
    except Exception:  # noqa: BLE001
        return torch.device("cpu")


def attach(engine, cfg: TrainguardConfig, guard_enabled: bool = True) -> EngineGuard:
    """Guard an existing engine in place. Returns the adapter state (also ``engine._trainguard``)."""
    state = EngineGuard(engine, cfg, guard_enabled=guard_enabled)
    # nn.Module.__setattr__ would try to register modules; this is a plain attribute.
    object.__setattr__(engine, "_trainguard", state)
    engine.__class__ = _guarded_class(type(engine))
    return state
