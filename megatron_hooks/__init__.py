"""Megatron-core adapter: the same guard, config block, events and JSONL as the DeepSpeed one.

    import megatron_hooks
    model = [DistributedDataParallel(config, ddp_config, gpt_model)]        # your model chunks
    optimizer = get_megatron_optimizer(opt_config, model)
    guard = megatron_hooks.install(model, optimizer, "trainguard.json")   # or a dict / the ds_config
    for iteration in ...:
        losses = forward_backward_func(...)                                # unchanged
        update_successful, grad_norm, num_zeros = optimizer.step()         # the guard decides here
    guard.close()

What ``install`` does, on every rank:

- puts the guard's AGREE/DECIDE around ``optimizer.step()``: one all-reduce of the ``[world, 8]``
  table over the default group, then every rank applies the step or skips it (a skipped step is
  ``optimizer.step()`` not called and the gradients zeroed: ``(False, None, None)`` comes back, as
  for an fp16 overflow);
- a tensor hook per parameter: each rank's *local* gradient is checked before megatron's
  data-parallel reduction (no second synchronisation: it rides in the same table);
- on the last pipeline stage, a forward hook reads the model's per-token loss (the local loss);
- forward hooks on every module record whether its output was finite (a device flag, read only on
  a non-finite step): the first non-finite module, the global layer number across pipeline stages
  (``TransformerLayer.layer_number``), and the *origin* rank -- a NaN that spread down the
  pipeline or through a tensor-parallel all-reduce is attributed to where it came first;
- the sampled probes (attention entropy from ``core_attention.scale_mask_softmax`` -- the local
  attention path only: fused/flash attention never materialises the probabilities -- and
  activation range) on sampled steps;
- every rank's (dp, tp, pp, cp, ep) coordinates from ``parallel_state``, in every verdict;
- fp16: megatron's ``DynamicGradScaler`` watched (its silent clamp at the minimum is a
  ``loss_scale`` collapse); the ladder resets the scale, raises its floor, and last turns the
  model chunks and optimizer into bf16 ones in place (megatron_hooks.precision).

Sample ids: call ``guard.on_batch(sample_ids)`` in your ``forward_step`` (optional). Forward
passes in eval mode (``model.eval()``, as Megatron-LM's ``evaluate`` does) are ignored.

Megatron-LM: :func:`extra_args_provider` adds ``--trainguard-config FILE``.

Snapshots: ``guard.checkpointer.save(dir, data_state=...)`` / ``.load(dir)`` (megatron_hooks.checkpoint).

The watchdog (``distributed.watchdog``) runs as on the DeepSpeed path: heartbeats, a hung rank
named, stacks, exit 75 for a restart.
"""
from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from trainguard import config as tg_config
from trainguard.checks import RunFacts
from trainguard.events import Action
from trainguard.guard import StepGuard
from trainguard.isolation import collective_device, gather_coords

__all__ = ["install", "extra_args_provider", "MegatronGuard"]


def _block(config) -> tg_config.TrainguardConfig:
    if isinstance(config, tg_config.TrainguardConfig):
        return config
    if isinstance(config, (str, os.PathLike)):
        raw = tg_config.read_json(str(config))
        raw = raw.get("trainguard", raw)  # a ds_config-style file with a block, or the block itself
        return tg_config.parse_block(raw)
    if isinstance(config, dict):
        return tg_config.parse_block(config.get("trainguard", config))
    raise TypeError(f"megatron_hooks.install: config must be a path, a dict or a TrainguardConfig, not "
                    f"{type(config).__name__}")


def _optimizers(optimizer) -> list:
    """The optimizers a megatron optimizer is made of: a ChainedOptimizer's, else itself."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module") and isinstance(chunk.module, torch.nn.Module):
        chunk = chunk.module
    return chunk


class _Finite:
    """Per-module 'was the output finite' flags, in forward order (device tensors, no sync)."""

    def __init__(self, chunks: Sequence[torch.nn.Module], stage: int):
        self.stage = stage
        self.names: list[str] = []
        self.layer_of: dict[str, int | None] = {}
        self.flags: list[tuple[int, torch.Tensor]] = []
        self.handles = []
        for ci, chunk in enumerate(chunks):
            layer = None
            for name, m in _unwrap(chunk).named_modules():
                if not name:
                    continue
                path = f"{ci}.{name}" if len(chunks) > 1 else name
                layer_number = getattr(m, "layer_number", None)
                if isinstance(layer_number, int) and type(m).__name__ == "TransformerLayer":
                    layer = layer_number
                self.layer_of[path] = layer if name.startswith("decoder.layers.") else None
                idx = len(self.names)
                self.names.append(path)
                self.handles.append(m.register_forward_hook(self._hook(idx)))

    def _hook(self, idx: int):
        def hook(module, args, output):
            if not module.training:
                return None
            t = output[0] if isinstance(output, (tuple, list)) and output else output
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.flags.append((idx, torch.isfinite(t.detach()).all()))
            return None
        return hook

    def first_nonfinite(self) -> dict:
        """The first module, in the order outputs were produced (a module's output comes after its
        children's), whose output was non-finite. Anomaly steps only: reading the flags syncs."""
        for pos, (idx, ok) in enumerate(self.flags):
            if not bool(ok):
                name = self.names[idx]
                return {"module": name, "global_layer": self.layer_of.get(name), "pipeline_stage": self.stage,
                        "origin_order": [self.stage, pos], "modules_checked": len(self.names)}
        return {"module": None, "note": "every module output was finite (the loss or a gradient was not)"}

    def reset(self) -> None:
        self.flags.clear()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


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

    def active(self) -> bool:
        return bool(self.scalers)

    def state(self):
        from trainguard.detectors.loss_scale import ScalerState

        g = self.scalers[0]
        return ScalerState(float(g.scale), float(g.min_scale), int(g._hysteresis_tracker))  # (one host read)

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


class MegatronGuard:
    """The adapter's state on one rank (``install`` returns it)."""

    def __init__(self, chunks: Sequence[torch.nn.Module], optimizer, cfg: tg_config.TrainguardConfig,
                 start_iteration: int = 0, guard_enabled: bool = True):
        from megatron.core import parallel_state as ps

        from megatron_hooks.checkpoint import MegatronCheckpointer
        from trainguard.faults import FaultInjector
        from trainguard.watchdog import Heartbeat

        self.chunks = list(chunks)
        self.optimizer = optimizer
        self.cfg = cfg
        self.iteration = start_iteration
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.stage = ps.get_pipeline_model_parallel_rank()
        self.last_stage = ps.is_pipeline_last_stage()
        self.heart = Heartbeat(self.rank)
        self.guard: StepGuard | None = None
        if guard_enabled:
            self.guard = StepGuard(cfg, self.rank, self.world, group=None, device=collective_device(),
                                   localize=self._localize)
            self.faults = self.guard.faults if cfg.faults else None
        else:  # faults only: plain megatron with the same injected faults, for comparisons
            self.faults = FaultInjector(cfg.faults, self.rank) if cfg.faults else None
        if self.faults is not None:
            self.faults.precision = _dtype(self.chunks[0])
        scaler = _GradScaler(optimizer)
        self.scaler = scaler if scaler.active() and cfg.detectors.loss_scale.enabled and guard_enabled else None
        if self.guard is not None:
            self.guard.attach_model(_unwrap(self.chunks[0]) if len(self.chunks) == 1 else torch.nn.ModuleList(
                [_unwrap(c) for c in self.chunks]))
        self._hooks: list = []
        self._probing = None
        self._install_hooks()  # (fault hooks first, so that the finiteness flags see what they did)
        self._finite = _Finite(self.chunks, self.stage) if cfg.detectors.localize.enabled and guard_enabled \
            else None
        self._base_step = optimizer.step
        optimizer.step = self.step  # the instance's step: the guard decides first
        self.checkpointer = MegatronCheckpointer(self) if self.guard is not None else None
        self.watchdog = None
        if self.guard is None:
            return
        coords = gather_coords(dp=ps.get_data_parallel_rank(), tp=ps.get_tensor_model_parallel_rank(),
                               pp=self.stage, local_rank=int(os.environ.get("LOCAL_RANK", 0)),
                               cp=ps.get_context_parallel_rank(), ep=ps.get_expert_model_parallel_rank())
        import megatron.core

        self.guard.on_begin(coords, {
            "framework": "megatron-core", "megatron_core": megatron.core.__version__, "torch": torch.__version__,
            "parallel": {"tp": ps.get_tensor_model_parallel_world_size(),
                         "pp": ps.get_pipeline_model_parallel_world_size(),
                         "dp": ps.get_data_parallel_world_size(), "cp": ps.get_context_parallel_world_size()},
            "optimizer": type(optimizer).__name__,
            "grad_check_point": "local, before the data-parallel reduction (tensor hooks)"},
            RunFacts(dtype=_dtype(self.chunks[0]), bf16_supported=True, warmup_steps=-1, scheduler=None,
                     framework_clip=float(getattr(getattr(optimizer, "config", None), "clip_grad", 0.0) or 0.0)))
        from trainguard.watchdog import Watchdog

        self.watchdog = Watchdog(cfg, self.guard, self.heart, self.rank, self.world, lambda: self.iteration)
        self.watchdog.start()

    def step_number(self) -> int:
        return self.iteration + 1

    def heart_beat(self, phase: str) -> None:
        self.heart.beat(phase, self.iteration)

    # ------------------------------------------------------------------ hooks
    def _install_hooks(self) -> None:
        from trainguard import gradhooks

        named = [(n, p) for c in self.chunks for n, p in _unwrap(c).named_parameters() if p.requires_grad]
        check = self.guard is not None and self.cfg.detectors.nonfinite.enabled and \
            self.cfg.detectors.nonfinite.check_grads
        self._hooks += gradhooks.install(named, self.faults, self.step_number, self._on_grad if check else None)
        for chunk in self.chunks:
            inner = _unwrap(chunk)
            self._hooks.append(inner.register_forward_pre_hook(self._on_forward_pre))
            if self.last_stage and (self.guard is not None or self.faults is not None):
                self._hooks.append(inner.register_forward_hook(self._on_output))
            if self.faults is not None:
                self._hooks += self.faults.install_module_faults(inner, self.step_number)

    def _on_grad(self, grad):
        self.guard.on_backward(grad)
        return None

    def _on_forward_pre(self, module, args):
        if not module.training:  # evaluation passes (model.eval()) are not training steps
            return None
        self.heart.beat("forward", self.step_number())
        if self._probing is None and self.guard is not None:  # the first micro-batch of the step opens the sampled probes
            self._probing = self.guard.probing(self.step_number())
            self._probing.__enter__()
        if self.faults is not None:
            self.faults.process(self.step_number())
        return None

    def _on_output(self, module, args, output):
        """Last stage: ``output`` is the per-token loss (labels were given); its mean is the local loss."""
        if not module.training or not isinstance(output, torch.Tensor) or not output.is_floating_point():
            return None
        scalar = output.detach().float().mean()
        seen = self.guard.on_loss(self.step_number(), scalar) if self.guard is not None else \
            self.faults.loss(self.step_number(), scalar)
        if seen is not scalar:  # a loss fault (nan_loss, spike) changed it: carry that into the real loss
            return output * (seen / scalar).to(output.dtype)
        return None

    def on_batch(self, sample_ids: Sequence[int] | None = None, position=None) -> None:
        """Optional, from your forward_step: this micro-batch's sample ids (named in verdicts).
        Ignored while the model is in eval mode (evaluation is not a training step)."""
        if self.guard is not None and all(_unwrap(c).training for c in self.chunks):
            self.guard.on_batch(list(sample_ids or []), position)

    def _localize(self) -> dict:
        if self._finite is None:
            return {"module": None, "note": "detectors.localize is off"}
        report = self._finite.first_nonfinite()
        report["rank"] = self.rank
        return report

    # ------------------------------------------------------------------ the step
    def step(self, *args, **kwargs):
        """``optimizer.step()`` with the guard's decision first; the same return value."""
        guard = self.guard
        step = self.step_number()
        self.heart.beat("collective", step)
        if guard is None:  # faults only
            result = self._base_step(*args, **kwargs)
            self.faults.step_done(step)
            self.iteration += 1
            return result
        if self._probing is not None:
            self._probing.__exit__(None, None, None)
            self._probing = None
        before = self.scaler.state() if self.scaler is not None else None
        obs = guard.on_agree(step, loss_scale=before.scale if before else 1.0, dynamic_scale=before is not None)
        decision = guard.on_decide(step, obs)
        if decision.action is Action.ABORT:
            raise guard.abort(step, decision)
        if decision.action in (Action.SKIP_STEP, Action.ROLLBACK) and decision.anomaly != "overflow":
            self.optimizer.zero_grad()
            for chunk in self.chunks:
                if hasattr(chunk, "zero_grad_buffer"):
                    chunk.zero_grad_buffer()
            result, applied, norm = (False, None, None), False, None
        else:  # (an fp16 overflow too: megatron finds it, skips and lowers its scale itself)
            result = self._base_step(*args, **kwargs)
            applied = bool(result[0]) if isinstance(result, tuple) else True
            norm = result[1] if isinstance(result, tuple) and len(result) > 1 else None
        scale_decision = guard.on_step(step, decision, applied, before)
        lr = None
        groups = getattr(self.optimizer, "param_groups", None)
        if groups:
            lr = float(groups[0].get("lr", 0.0))
        guard.on_end(step, obs, {"grad_norm": norm, "clip_limit": None, "lr": lr,
                                 "loss_scale": before.scale if before else 1.0,
                                 "skipped_steps": guard.skipped_steps, "applied": applied,
                                 "action": decision.action.value, "goodput": guard.goodput.ratio()})
        guard.goodput.step_done(step, applied)
        if self.checkpointer is not None:
            losses = [o.loss for o in obs if o.has_loss]
            loss = sum(losses) / len(losses) if losses and all(math.isfinite(x) for x in losses) else None
            self.checkpointer.on_step_end(step, loss, anomaly=any(v.anomaly != "overflow"
                                                                  for v in decision.verdicts))
        if self._finite is not None:
            self._finite.reset()
        self.iteration += 1
        self.heart.beat("data", self.iteration)
        acting = scale_decision or decision
        if acting.action is Action.ABORT:
            raise guard.abort(step, acting)
        if acting.action is Action.ROLLBACK:
            rolled = self._rollback(step, acting)
            if acting.anomaly == "loss_scale":
                self._scale_remedy(step, acting, rolled)
        return result

    def _rollback_root(self) -> Path | None:
        if self.cfg.checkpoint.dir:
            return Path(self.cfg.checkpoint.dir)
        roots = list(self.checkpointer.roots.values())
        return roots[-1] if roots else None

    def _rollback(self, step: int, decision) -> bool:
        """In-process rollback to a snapshot (checkpoint.dir, else where the last one was saved), on
        every rank together: weights, optimizer state and RNG come back; the iteration count goes back
        with them. Your data iterator is not rewound -- it continues past the batches already seen,
        which is the point (so ``skip_batches`` and the quarantine of sample ids are DeepSpeed-only:
        megatron's data is yours); the LR scheduler is yours too, so ``lr_factor`` is not applied."""
        guard, rc = self.guard, self.cfg.recovery
        root = self._rollback_root()
        tag, why = (None, "no snapshot directory: set trainguard.checkpoint.dir or call guard.checkpointer.save") \
            if root is None else self.checkpointer.rollback_target(root, decision.onset_step or step, rc.rollback_to,
                                                                  inclusive=decision.onset_skipped)
        if tag is None:
            guard._emit(step, "rollback_unavailable", [], "skip_step", {
                "reason": why, "anomaly": decision.anomaly, "onset_step": decision.onset_step})
            return False
        self.checkpointer.load(root, tag=tag, purpose="rollback")
        to_step = self.iteration
        guard.goodput.rollback(to_step)
        abandoned = self.checkpointer.abandon_after(root, to_step)
        guard.policy.rolled_back(step, False, {"to_tag": tag, "to_step": to_step, "anomaly": decision.anomaly})
        guard.grad_norm.reset_trend()
        if self.faults is not None:
            self.faults.rolled_back()
        guard._emit(step, "rollback", [], "rollback", {
            "to_tag": tag, "to_step": to_step, "why": why, "anomaly": decision.anomaly,
            "onset_step": decision.onset_step, "abandoned": abandoned, "reason": decision.reason,
            "lr_factor": None, "skip_batches": 0,
            "note": "megatron: the data iterator is yours and continues; the LR schedule is yours and is unchanged"})
        return True

    def _scale_remedy(self, step: int, decision, rolled_back: bool) -> None:
        """The loss_scale ladder's remedy, after its rollback (or in place, without a snapshot): reset
        the scale, raise the floor, or continue in bf16 (megatron_hooks.precision)."""
        guard = self.guard
        if decision.remedy == "bf16":
            detail = {**self.fallback_to_bf16(step, decision), "after_rollback": rolled_back}
            guard.policy.tried_also(step, "bf16_fallback", detail)
            guard._emit(step, "precision_fallback", [], "bf16_fallback", detail)
            return
        detail = {}
        if decision.remedy == "raise_floor":
            detail.update(self.scaler.raise_floor(self.cfg.recovery.floor_factor))
        detail.update(self.scaler.reset())
        guard.loss_scale.reset()
        guard.policy.tried_also(step, decision.remedy, {**detail, "after_rollback": rolled_back})
        guard._emit(step, "loss_scale_reset", [], decision.remedy, detail)

    def fallback_to_bf16(self, step: int, decision=None) -> dict:
        """Turn the fp16 model chunks and optimizer into bf16 ones, in place (every rank). Without a
        ``decision`` (a resume from a bf16 snapshot) a failure raises; with one, it aborts the run
        with the ladder's report."""
        from megatron_hooks.precision import FallbackUnavailable, fallback_to_bf16

        try:
            detail = fallback_to_bf16(self.chunks, self.optimizer)
        except FallbackUnavailable as e:
            if decision is None:
                raise
            from trainguard.policy import Decision

            from megatron_hooks.checkpoint import _distributed

            advice = ("restart in fp16 from the newest snapshot with a higher min_loss_scale (with the distributed "
                      "optimizer an fp16 snapshot does not load into a bf16 run)" if _distributed(self.optimizer)
                      else "restart from the newest snapshot with bf16 enabled")
            raise self.guard.abort(step, Decision(Action.ABORT, f"{decision.reason}: bf16 fallback unavailable: {e}; "
                                                  f"{advice}", decision.verdicts)) from None
        if getattr(self.optimizer, "step", None) != self.step:  # (a rebuilt optimizer: the guard decides again)
            self.optimizer.step = self.step
        self.scaler = None  # bf16: no loss scale to watch
        self.guard.loss_scale.reset()
        if self.faults is not None:
            self.faults.precision = "bf16"
        return {"from": "fp16", "to": "bf16", "at_step": self.iteration, **detail}

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self._finite is not None:
            self._finite.remove()
        if getattr(self.optimizer, "step", None) == self.step:
            self.optimizer.step = self._base_step
        if self.guard is not None:
            self.guard.on_close({"iterations": self.iteration, "goodput": self.guard.goodput.summary()})


def install(model: torch.nn.Module | Sequence[torch.nn.Module], optimizer, config: Any,
            start_iteration: int = 0, guard_enabled: bool = True) -> MegatronGuard:
    """Guard a megatron-core model (a module or a list of model chunks) and its optimizer.

    ``config``: the trainguard block as a dict, a JSON file (the block itself, or a ds_config-style
    file holding a ``"trainguard"`` key), or a parsed :class:`trainguard.config.TrainguardConfig`.
    Call after ``parallel_state.initialize_model_parallel`` and after the optimizer is built.
    ``guard_enabled=False``: only the configured faults (plain megatron under the same faults, for
    comparisons and drills)."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    cfg = _block(config)
    return MegatronGuard(chunks, optimizer, cfg, start_iteration=start_iteration, guard_enabled=guard_enabled)


def extra_args_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """For Megatron-LM's ``pretrain(..., extra_args_provider=...)``: adds ``--trainguard-config``."""
    group = parser.add_argument_group(title="trainguard")
    group.add_argument("--trainguard-config", type=_existing_file, default=None, metavar="FILE",
                       help="JSON file with the trainguard block (or a ds_config-style file holding one); the "
                            "block is validated here, so a bad key stops the launch at once")
    return parser


def _existing_file(value: str) -> str:
    path = Path(value)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"--trainguard-config: {value} is not a file")
    try:
        _block(str(path))
    except tg_config.ConfigError as e:
        raise argparse.ArgumentTypeError(f"--trainguard-config {value}: {e}") from None
    return str(path)


def _dtype(chunk: torch.nn.Module) -> str:
    p = next(_unwrap(chunk).parameters(), None)
    if p is None:
        return "fp32"
    return {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(p.dtype, "fp32")
