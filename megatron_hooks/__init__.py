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

- puts the guard's AGREE/DECIDE around ``optimizer.step()``: one all-reduce of the ``[world, 8]`` table over the
  default group, then every rank applies the step or skips it (a skipped step is ``optimizer.step()`` not called
  and the gradients zeroed: ``(False, None, None)`` comes back, as for an fp16 overflow);
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

Sample ids: call ``guard.on_batch(sample_ids)`` in your ``forward_step`` (optional). Forward passes in eval mode
(``model.eval()``, as Megatron-LM's ``evaluate`` does) are ignored.

Megatron-LM's own loop: ``trainguard run -- torchrun ... pretrain_gpt.py ... --trainguard-config tg.json``
(megatron_hooks.lm); :func:`extra_args_provider` is the argument it adds.

Snapshots: ``guard.checkpointer.save(dir, data_state=...)`` / ``.load(dir)`` (megatron_hooks.checkpoint);
with ``checkpoint.dir`` and ``checkpoint.every_steps`` the guard saves by itself (with what
``install(data_state=callable)`` returns) and resumes at ``install`` (``guard.iteration``,
``guard.resumed_data_state``). The step sequence is trainguard.driver's, as on DeepSpeed; keys this
adapter cannot apply are refused at ``install`` (trainguard.support).

The watchdog (``distributed.watchdog``) runs as on the DeepSpeed path: heartbeats, a hung rank named, stacks, exit
75 for a restart; under trainguard.supervise, ``supervised(train)`` survives a dead rank in-process (docs/liveness.md).
"""
from __future__ import annotations

import os
from typing import Any, Sequence

import torch
import torch.distributed as dist

from trainguard import config as tg_config
from trainguard.ports import (
    bf16_supported, check_supported, collective_device, gather_coords, OutputFlags, PoisonFirstLeaf, releases,
    RunFacts, StepOutcome, zero_adam_moments,
)
from trainguard.errors import FallbackUnavailable
from trainguard.events import Action, Anomaly
from trainguard.session import GuardSession

from megatron_hooks import versions
from megatron_hooks.capabilities import REFUSED
from megatron_hooks.args import extra_args_provider
from megatron_hooks.parts import _GradScaler, _dtype, _modules, _optimizers, _unwrap  # noqa: F401 (the package's)
from megatron_hooks.inprocess import supervised  # (your loop, entered again after a rank died)

__all__ = ["install", "extra_args_provider", "MegatronGuard", "supervised"]


class MegatronGuard:
    """The adapter's state on one rank (``install`` returns it)."""

    data = None  # trainguard.protocols.Framework: megatron's data loader is the user's (no skip, no quarantine)

    def __init__(self, chunks: Sequence[torch.nn.Module], optimizer, cfg: tg_config.TrainguardConfig,
                 start_iteration: int = 0, guard_enabled: bool = True, data_state=None, loop=None, replayer=None):
        from megatron.core import parallel_state as ps

        from megatron_hooks.checkpoint import MegatronState

        self.chunks = list(chunks)
        self.optimizer = optimizer
        self.cfg = cfg
        self.iteration = start_iteration
        self.data_state = data_state   # callable: the user's data position, saved with each snapshot
        self.resumed_data_state = None  # what the automatic resume at install brought back
        self.not_applied = 0            # steps not applied (the guard's skips and megatron's own)
        self.loop = loop                # a loop that owns the iteration (megatron_hooks.lm), or None
        self.last_applied = False       # whether the last optimizer.step() applied its update
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.stage = ps.get_pipeline_model_parallel_rank()
        self.last_stage = ps.is_pipeline_last_stage()
        self.replayer = replayer        # megatron_hooks.replay.Replayer: data or weights (trainguard.replay)
        self._poison = None             # this micro-batch's nan_batch poison (an integer batch: at the first leaf)
        self._poisoning = None
        self._first_forward = True      # the step's first training forward (its first micro-batch) is still to come
        self.checkpointer = None
        self.applied_grad = None  # trainguard.appliedgrad.AppliedGradMeter on the inner torch optimizer(s)
        peers = dist.get_process_group_ranks(ps.get_model_parallel_group()) if replayer is not None else None
        self.session = GuardSession(self, cfg, self.rank, self.world, guard_enabled=guard_enabled,
                                    device=collective_device(), localize=self._localize,
                                    replay=self._replay if replayer is not None else None,
                                    narrow_rows=replayer is not None, replay_peers=peers,
                                    peer_replay=self._peer_replay if replayer is not None else None)
        s = self.session
        self.guard, self.faults, self.heart, self.driver, self._hooks = s.guard, s.faults, s.heart, s.driver, s.hooks
        if self.faults is not None:
            self.faults.precision = _dtype(self.chunks[0])
        scaler = _GradScaler(optimizer)
        self.grad_scaler = scaler if scaler.active() and guard_enabled else None
        if replayer is not None:
            replayer.poison_module = self._poison_forward
            if self.faults is not None:
                replayer.held = self.faults.held
        if self.guard is not None:
            self.guard.attach_model(_unwrap(self.chunks[0]) if len(self.chunks) == 1 else torch.nn.ModuleList(
                [_unwrap(c) for c in self.chunks]))
        self._probing = None
        self._install_hooks()  # (fault hooks first, so that the finiteness flags see what they did)
        self._finite = OutputFlags(_modules(self.chunks), self.stage) if cfg.detectors.localize.enabled and \
            guard_enabled else None
        if self._finite is not None:
            self._hooks.append(self._finite)
        self._base_step = optimizer.step
        optimizer.step = self.step  # the instance's step: the guard decides first
        if self.guard is None:
            return
        self.applied_grad = self._applied_grad_meter()
        s.arm(self._clip_grad())
        coords = gather_coords(dp=ps.get_data_parallel_rank(), tp=ps.get_tensor_model_parallel_rank(),
                               pp=self.stage, local_rank=int(os.environ.get("LOCAL_RANK", 0)),
                               cp=ps.get_context_parallel_rank(), ep=ps.get_expert_model_parallel_rank())
        import megatron.core

        self.checkpointer = s.start(MegatronState(self), coords, {
            "framework": "megatron-core", "megatron_core": megatron.core.__version__, "torch": torch.__version__,
            "releases": {"megatron-core": megatron.core.__version__},
            "untested_releases": [] if releases.supported("megatron-core", megatron.core.__version__)
            else ["megatron-core"],
            "parallel": {"tp": ps.get_tensor_model_parallel_world_size(),
                         "pp": ps.get_pipeline_model_parallel_world_size(),
                         "dp": ps.get_data_parallel_world_size(), "cp": ps.get_context_parallel_world_size()},
            "optimizer": type(optimizer).__name__,
            "grad_check_point": "local, before the data-parallel reduction (tensor hooks)"},
            RunFacts(dtype=_dtype(self.chunks[0]), bf16_supported=bf16_supported(),
                     # (your scheduler is not ours to read; Megatron-LM's is: megatron_hooks.lm)
                     warmup_steps=loop.warmup_steps() if loop is not None else -1,
                     scheduler=type(loop.scheduler).__name__ if loop is not None and loop.scheduler is not None else None,
                     framework_clip=self._clip_grad()))
        self.resumed_data_state = s.running(newer_than=start_iteration)  # (only a snapshot newer than your own)

    @property
    def watchdog(self):
        return self.session.watchdog

    def step_number(self) -> int:
        return self.iteration + 1

    def heart_beat(self, phase: str) -> None:
        self.session.beat(phase, self.iteration)

    # ------------------------------------------------------------------ hooks
    def _install_hooks(self) -> None:
        from trainguard.ports import install_grad_hooks

        named = [(n, p) for c in self.chunks for n, p in _unwrap(c).named_parameters() if p.requires_grad]
        check = self.guard is not None and self.cfg.detectors.nonfinite.enabled and \
            self.cfg.detectors.nonfinite.check_grads
        self._hooks += install_grad_hooks(named, self.faults, self.step_number, self._on_grad if check else None)
        for chunk in self.chunks:
            inner = _unwrap(chunk)
            self._hooks.append(inner.register_forward_pre_hook(self._on_forward_pre))
            self._hooks.append(inner.register_forward_hook(self._on_forward_done))
            if self.last_stage and (self.guard is not None or self.faults is not None):
                self._hooks.append(inner.register_forward_hook(self._on_output))
            if self.faults is not None:
                self._hooks += self.faults.install_module_faults(inner, self.step_number)

    def _on_grad(self, grad):
        self.session.backward(grad)
        return None

    def _on_forward_pre(self, module, args):
        if not module.training:  # evaluation passes (model.eval()) are not training steps
            return None
        step = self.step_number()
        if self._probing is None and self.guard is not None:  # the first micro-batch of the step opens the sampled probes
            self._probing = self.session.probing(step)
            self._probing.__enter__()
        # megatron's inputs are token ids: spike_batch scales this rank's loss (on the last pipeline stage, where the
        # loss is); nan_batch poisons the first leaf module's output (one row with `sample`), of the step's first
        # micro-batch only -- one bad sample, which replays with its micro-batch
        _, poison = self.session.forward(step, args, batch_faults=self._first_forward)
        if self._first_forward:
            self._poison = poison
            if poison is not None:
                self._poisoning = PoisonFirstLeaf(module, poison).__enter__()
        self._first_forward = False
        return None

    def _on_forward_done(self, module, args, output):
        if self._poisoning is not None:
            self._poisoning.__exit__(None, None, None)
            self._poisoning = None
        if module.training:  # (the step's own time: the straggler detector)
            self.session.forward_done()
        return None

    def record(self, drawn: list) -> None:
        """From the loop, after each training micro-batch's forward step: what this rank drew from its data
        iterator for it (megatron_hooks.replay.Recording), kept with its poison for a replay."""
        if self.guard is not None and self.guard.wants_batches:
            self.guard.record_micro_batch((list(drawn), self._poison), self.replayer.micro_batch_size)
        self._poison = None

    def _replay(self, mb, row):
        drawn, poison = mb.inputs
        return self.replayer.replay(drawn, poison, row)

    def _peer_replay(self, inputs, seed: int):
        """detectors.peer_replay: what a rank drew for a micro-batch (its own or its replica's), forward-only through
        megatron's schedule in eval mode (no random numbers drawn), the whole model-parallel group together.
        Returns (its loss, None): the schedule gives back the loss only."""
        (drawn, poison), _ = inputs  # (no RNG state: eval mode draws none)
        return self.replayer.replay(list(drawn), poison, None), None

    def _poison_forward(self, poison):
        return PoisonFirstLeaf(_unwrap(self.chunks[0]), poison)

    def _on_output(self, module, args, output):
        """Last stage: ``output`` is the per-token loss (labels were given); its mean is the local loss."""
        if not module.training or not isinstance(output, torch.Tensor) or not output.is_floating_point():
            return None
        scalar = output.detach().float().mean()
        seen = self.session.loss(self.step_number(), scalar)
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
        """``optimizer.step()`` with the guard's decision first (trainguard.driver); the same return value."""
        self._first_forward = True
        if self._probing is not None:
            self._probing.__exit__(None, None, None)
            self._probing = None
        try:
            return self.session.step(lambda: self._base_step(*args, **kwargs))
        finally:
            if self._finite is not None:
                self._finite.reset()

    # ------------------------------------------------------------------ trainguard.protocols.Framework
    def completed_steps(self) -> int:
        return self.iteration

    def scaler(self):
        return self.grad_scaler

    def agree_scale(self) -> tuple[float, float]:
        # (the scale as read by the driver before the step: one host read per step)
        return (self.grad_scaler.last_scale if self.grad_scaler is not None else 1.0), 1.0

    def _clip_grad(self) -> float:
        return float(getattr(getattr(_optimizers(self.optimizer)[0], "config", None), "clip_grad", 0.0) or 0.0)

    def _applied_grad_meter(self):
        """Where megatron clips: its inner torch optimizers step with the clipped main gradients. Measured
        over megatron's own list for the norm (shared and tensor-parallel duplicates left out); without
        the distributed optimizer every data-parallel replica holds the same gradients."""
        from megatron.core import parallel_state as ps
        from trainguard.ports import AppliedGradMeter

        from megatron_hooks.checkpoint import _distributed

        outer = {id(o.optimizer): o for o in _optimizers(self.optimizer)
                 if isinstance(getattr(o, "optimizer", None), torch.optim.Optimizer)
                 and hasattr(o, "get_main_grads_for_grad_norm")}
        if not outer:
            return None
        replication = 1 if _distributed(self.optimizer) else ps.get_data_parallel_world_size(with_context_parallel=True)
        meter = AppliedGradMeter([o.optimizer for o in outer.values()], replication=replication,
                                 grads=lambda inner: outer[id(inner)].get_main_grads_for_grad_norm())
        self._hooks.append(meter)
        return meter

    def set_clip(self, max_norm: float) -> None:
        """megatron clips inside optimizer.step() by its config's clip_grad (the global norm it computes anyway)."""
        for o in _optimizers(self.optimizer):
            if getattr(o, "config", None) is not None:
                o.config.clip_grad = float(max_norm)

    def apply(self, decision, base_step) -> StepOutcome:
        if decision.action in (Action.SKIP_STEP, Action.ROLLBACK) and decision.anomaly is not Anomaly.OVERFLOW:
            self.optimizer.zero_grad()
            for chunk in self.chunks:
                if hasattr(chunk, "zero_grad_buffer"):
                    chunk.zero_grad_buffer()
            result, applied, norm = (False, None, None), False, None
            if self.loop is not None:
                self.loop.not_applied()
        else:  # (an fp16 overflow too: megatron finds it, skips and lowers its scale itself)
            result = base_step()
            applied = bool(result[0]) if isinstance(result, tuple) else True
            norm = result[1] if isinstance(result, tuple) and len(result) > 1 else None
        self.not_applied += not applied
        self.last_applied = applied
        self.iteration += 1
        limit = self._clip_grad()
        return StepOutcome(result, applied, norm, limit or None)

    def lr_groups(self) -> list[dict]:
        return list(getattr(self.optimizer, "param_groups", None) or [])

    def after_rollback(self, step: int) -> dict:
        """Your loop reads ``guard.iteration`` (the snapshot's): nothing more. A loop that owns its
        iteration (Megatron-LM's) goes on at ``step``: the guard counts from there again."""
        if self.loop is None:
            return {}
        loaded, self.iteration = self.iteration, step
        return self.loop.rolled_back(loaded, step)

    def skipped_steps(self) -> int:
        return self.not_applied

    def reset_moments(self) -> int:
        return sum(zero_adam_moments(getattr(o, "optimizer", o)) for o in _optimizers(self.optimizer))

    def fallback_to_bf16(self, step: int) -> dict:
        """Turn the fp16 model chunks and optimizer into bf16 ones, in place (every rank); raises
        trainguard.errors.FallbackUnavailable with what to do instead."""
        from megatron_hooks.checkpoint import _distributed
        from megatron_hooks.precision import fallback_to_bf16

        try:
            detail = fallback_to_bf16(self.chunks, self.optimizer)
        except FallbackUnavailable as e:
            advice = ("restart in fp16 from the newest snapshot with a higher min_loss_scale (with the distributed "
                      "optimizer an fp16 snapshot does not load into a bf16 run)" if _distributed(self.optimizer)
                      else "restart from the newest snapshot with bf16 enabled")
            raise FallbackUnavailable(f"{e}; {advice}") from None
        if getattr(self.optimizer, "step", None) != self.step:  # (a rebuilt optimizer: the guard decides again)
            self.optimizer.step = self.step
        if self.applied_grad is not None:
            self.applied_grad.remove()
        self.applied_grad = self._applied_grad_meter()
        self.grad_scaler = None  # bf16: no loss scale to watch
        self.guard.scaler_reset()
        if self.faults is not None:
            self.faults.precision = "bf16"
        return {"from": "fp16", "to": "bf16", "at_step": self.iteration, **detail}

    def close(self, clean: bool = True) -> None:
        """The end of the run. ``clean=False`` (the loop raised: a peer died, ...): the snapshots in node memory
        stay for the restart, and no writer is waited for (its peer may be gone)."""
        if getattr(self.optimizer, "step", None) == self.step:
            self.optimizer.step = self._base_step
        self.session.close({"iterations": self.iteration}, clean=clean)


def install(model: torch.nn.Module | Sequence[torch.nn.Module], optimizer, config: Any,
            start_iteration: int = 0, guard_enabled: bool = True, data_state=None, loop=None,
            replayer=None) -> MegatronGuard:
    """Guard a megatron-core model (a module or a list of model chunks) and its optimizer.

    ``config``: the trainguard block as a dict, a JSON file (the block itself, or a ds_config-style
    file holding a ``"trainguard"`` key), or a parsed :class:`trainguard.config.TrainguardConfig`.
    Call after ``parallel_state.initialize_model_parallel`` and after the optimizer is built.
    ``guard_enabled=False``: only the configured faults (plain megatron under the same faults, for
    comparisons and drills). ``start_iteration``: where your loop is (e.g. after loading your own
    checkpoint): the automatic resume loads only a newer snapshot. ``loop``: for a training loop
    that owns its iteration counter (megatron_hooks.lm); None for yours. ``replayer``: a
    :class:`megatron_hooks.replay.Replayer` over your forward step (and your loop calls ``record`` with
    what each micro-batch drew): data or weights (``recovery.replay_check``, ``narrow_samples``) --
    Megatron-LM's loop has one; without it the ladders act as written."""
    import megatron.core

    versions.check(megatron.core.__version__)
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    cfg = tg_config.block_of(config, "megatron_hooks.install")
    check_supported(cfg, "megatron_hooks", REFUSED)  # a key set here that megatron cannot honour: refused, by name
    from trainguard.ports import check_release

    check_release(cfg, "megatron-core", megatron.core.__version__)  # (a key this release cannot run: refused)
    if replayer is None:
        asked = [k for k in ("replay_check", "narrow_samples") if k in cfg.recovery.model_fields_set
                 and getattr(cfg.recovery, k)]
        if asked:
            raise tg_config.ConfigError([(f"trainguard.recovery.{k}", "true needs a replay of your forward step: pass "
                                          "megatron_hooks.install(..., replayer=Replayer(...)) and call guard.record(...) "
                                          "per micro-batch (Megatron-LM's loop does both), or set false") for k in asked])
    return MegatronGuard(chunks, optimizer, cfg, start_iteration=start_iteration, guard_enabled=guard_enabled,
                         data_state=data_state, loop=loop, replayer=replayer)
