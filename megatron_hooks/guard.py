"""The megatron-core adapter's state on one rank (megatron_hooks.install builds it): the guard's session, its AGREE/DECIDE
around ``optimizer.step()``, and the trainguard.protocols.Framework the driver acts through. Its hooks on the model
chunks: megatron_hooks.model_hooks."""
from __future__ import annotations

import os
from typing import Sequence

import torch
import torch.distributed as dist

from trainguard import config as tg_config
from trainguard.ports import (bf16_supported, collective_device, gather_coords, LaunchGate, releases, RunFacts, StepOutcome,
                              zero_adam_moments)
from trainguard.errors import FallbackUnavailable, interruption
from trainguard.events import Action, Anomaly
from trainguard.step.session import GuardSession

from megatron_hooks.capabilities import HINTS
from megatron_hooks.model_hooks import ModelHooks
from megatron_hooks.parts import _GradScaler, _dtype, _optimizers, _unwrap


class MegatronGuard:
    """The adapter's state on one rank (``install`` returns it)."""

    data = None  # trainguard.protocols.Framework: megatron's data loader is the user's (no skip, no quarantine)

    def __init__(self, chunks: Sequence[torch.nn.Module], optimizer, cfg: tg_config.TrainguardConfig,
                 start_iteration: int = 0, guard_enabled: bool = True, data_state=None, loop=None, replayer=None,
                 train_iters: int | None = None):
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
        self.replayer = replayer        # megatron_hooks.replay.Replayer: data or weights (trainguard.replay.replay)
        self.model_hooks = ModelHooks(self)  # (on the model chunks: megatron_hooks.model_hooks)
        self.checkpointer = None
        self.applied_grad = None  # the session's meter on the inner torch optimizer(s) (applied_grad_meter)
        peers = dist.get_process_group_ranks(ps.get_model_parallel_group()) if replayer is not None else None
        self.session = GuardSession(self, cfg, self.rank, self.world, guard_enabled=guard_enabled,
                                    device=collective_device(), localize=self.model_hooks.localize,
                                    replay=self.model_hooks.replay if replayer is not None else None,
                                    narrow_rows=replayer is not None, replay_peers=peers,
                                    peer_replay=self.model_hooks.peer_replay if replayer is not None else None,
                                    hints=HINTS)
        s = self.session
        self.guard, self.faults, self.heart, self.driver, self._hooks = s.guard, s.faults, s.heart, s.driver, s.hooks
        if self.faults is not None:
            self.faults.precision = _dtype(self.chunks[0])
        scaler = _GradScaler(optimizer)
        self.grad_scaler = scaler if scaler.active() and guard_enabled else None
        if replayer is not None:
            replayer.poison_module = self.model_hooks.poison_forward
            if self.faults is not None:
                replayer.held = self.faults.held
        if self.guard is not None:
            self.guard.attach_model(_unwrap(self.chunks[0]) if len(self.chunks) == 1 else torch.nn.ModuleList(
                [_unwrap(c) for c in self.chunks]))
        self.model_hooks.install(localize=cfg.detectors.localize.enabled and guard_enabled)
        self._base_step = optimizer.step
        optimizer.step = self.step  # the instance's step: the guard decides first
        if self.guard is None:
            return
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
            "optimizer": type(optimizer).__name__},
            RunFacts(dtype=_dtype(self.chunks[0]), bf16_supported=bf16_supported(),
                     # (your scheduler is not ours to read; Megatron-LM's is: megatron_hooks.lm)
                     warmup_steps=loop.warmup_steps() if loop is not None else -1,
                     scheduler=type(loop.scheduler).__name__ if loop is not None and loop.scheduler is not None else None,
                     framework_clip=self._clip_grad(), last_step=loop.last_step() if loop is not None else train_iters))
        self.resumed_data_state = s.running(newer_than=start_iteration)  # (only a snapshot newer than your own)

    @property
    def watchdog(self):
        return self.session.watchdog

    def step_number(self) -> int:  # (while one is applied, that one: a DECIDE after its launch replays it as it was)
        applying = self.driver.applying if self.driver is not None else None
        return applying if applying is not None else self.iteration + 1

    def heart_beat(self, phase: str) -> None:
        self.session.beat(phase, self.iteration)

    # ------------------------------------------------------------------ the step
    def step(self, *args, **kwargs):
        """``optimizer.step()`` with the guard's decision first (trainguard.step.driver); the same return value."""
        self.model_hooks.step_begins()
        try:
            return self.session.step(lambda: self._base_step(*args, **kwargs))
        finally:
            self.model_hooks.step_ended()

    def record(self, drawn: list) -> None:
        """From the loop, after each training micro-batch's forward step: what this rank drew from its data
        iterator for it (megatron_hooks.replay.Recording), kept with its poison for a replay."""
        self.model_hooks.record(drawn)

    def on_batch(self, sample_ids: Sequence[int] | None = None, position=None) -> None:
        """Optional, from your forward_step: this micro-batch's sample ids (named in verdicts).
        Ignored while the model is in eval mode (evaluation is not a training step)."""
        self.model_hooks.on_batch(sample_ids, position)

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

    def applied_grad_meter(self):
        """Where megatron clips: its inner torch optimizers step with the clipped main gradients. Measured
        over megatron's own list for the norm (shared and tensor-parallel duplicates left out); without
        the distributed optimizer every data-parallel replica holds the same gradients."""
        from megatron.core import parallel_state as ps
        from trainguard.ports import AppliedGradMeter

        from megatron_hooks.checkpoint import _distributed

        outer = {id(o.optimizer): (o.optimizer, getattr(o, "get_main_grads_for_grad_norm", None) or getattr(
            o, "get_grads_for_grad_norm", None)) for o in _optimizers(self.optimizer)  # (the latter: 0.19's name)
            if isinstance(getattr(o, "optimizer", None), torch.optim.Optimizer)}
        outer = {k: v for k, v in outer.items() if v[1] is not None}
        if not outer:
            return None
        replication = 1 if _distributed(self.optimizer) else ps.get_data_parallel_world_size(with_context_parallel=True)
        return AppliedGradMeter([inner for inner, _ in outer.values()], replication=replication,
                                grads=lambda inner: outer[id(inner)][1]())

    def set_clip(self, max_norm: float) -> None:
        """megatron clips inside optimizer.step() by its config's clip_grad (the global norm it computes anyway)."""
        for o in _optimizers(self.optimizer):
            if getattr(o, "config", None) is not None:
                o.config.clip_grad = float(max_norm)

    def launch_gate(self) -> LaunchGate | None:
        """Where megatron's optimizer step (one, not chained) ends in its torch optimizer's launch -- after its own
        global norm, read on the host (trainguard.step.launchgate; fp16's scaler the driver leaves out). A refused
        update returns megatron's own "not applied", as a skip of ours does."""
        opts = _optimizers(self.optimizer)
        inner = getattr(opts[0], "optimizer", None) if len(opts) == 1 else None
        if not isinstance(inner, torch.optim.Optimizer) or "Muon" in type(inner).__name__:
            return None
        self.declined = False
        return LaunchGate(inner, lambda: setattr(self, "declined", True), lambda: None)

    def apply(self, decision, base_step) -> StepOutcome:
        ours = decision.action in (Action.SKIP_STEP, Action.ROLLBACK) and decision.anomaly is not Anomaly.OVERFLOW
        if ours:
            self.optimizer.zero_grad()
            for chunk in self.chunks:
                if hasattr(chunk, "zero_grad_buffer"):
                    chunk.zero_grad_buffer()
            result, applied, norm = (False, None, None), False, None
        else:  # (an fp16 overflow too: megatron finds it, skips and lowers its scale itself)
            result = base_step()
            if getattr(self, "declined", False):  # (refused at the update's launch: trainguard.step.launchgate)
                self.declined, ours, result = False, True, (False, None, None)
            applied = bool(result[0]) if isinstance(result, tuple) else True
            norm = result[1] if isinstance(result, tuple) and len(result) > 1 else None
        self.not_applied += not applied
        self.last_applied = applied
        self.iteration += 1
        if ours and self.loop is not None:  # (after the count: the LR its scheduler sets is the next iteration's)
            self.loop.not_applied()
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
        self.grad_scaler = None  # bf16: no loss scale to watch (the session arms the rest again)
        return {"from": "fp16", "to": "bf16", "at_step": self.iteration, **detail}

    def close(self, clean: bool = True, why: BaseException | None = None) -> None:
        """The end of the run. ``clean=False`` (the loop raised: a peer died, ...): the snapshots in node memory
        stay for the restart, and no writer is waited for (its peer may be gone)."""
        if getattr(self.optimizer, "step", None) == self.step:
            self.optimizer.step = self._base_step
        self.session.close({"iterations": self.iteration, **interruption(why)}, clean=clean)
