"""The DeepSpeed engine, guarded: the user's loop is unchanged, the guard runs inside it.

``attach`` swaps the engine's class for a subclass (ds_plugins.guarded; ``isinstance(engine, DeepSpeedEngine)``
still holds) whose ``forward``, ``backward`` and ``step`` call the guard's loop points around DeepSpeed's own. The
non-finite check reads each rank's local gradients where DeepSpeed is about to reduce them (ds_plugins.facts.
_reduction_points: ZeRO-0 every gradient at the boundary, ZeRO-1/2 each bucket; ZeRO-3, a tensor hook a parameter):
it sees each rank's own values at every stage, and names the rank that produced them.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ds_plugins.applied_grad import _applied_grad_meter
from ds_plugins.capabilities import FRAMEWORK_HINTS, HINTS
from ds_plugins.facts import _collective_device, _coords, _dtype, _framework_facts, _reduction_points, _run_facts
from ds_plugins.guarded import _guarded_class, _plain_class
from ds_plugins.loss_scale import _loss_scale, ScalerView
from ds_plugins.skip import find_strategy, forced_skip, GATED
from trainguard.ports import (DataPosition, goes_on, LaunchGate, ModuleReplays, output_value, PoisonFirstLeaf, rng_state, rows_of,
                              StepOutcome, surviving, take_tags, zero_adam_moments)
from trainguard.config import TrainguardConfig
from trainguard.errors import FallbackUnavailable
from trainguard.events import Action
from trainguard.step.session import GuardSession


class EngineGuard:
    """The adapter's state on one rank: the core guard plus what only DeepSpeed knows."""

    world = None     # trainguard.liveness.world.World under trainguard.supervise: a rank that dies is replaced in-process
    rebuild = None   # (module, loader) -> (engine, its EngineGuard): the build again on a new world (ds_plugins)
    discard = False  # the rest of a step a rank's replacement interrupted does nothing

    def __init__(self, engine, cfg: TrainguardConfig, guard_enabled: bool = True, client_scheduler=None,
                 entry: str = "initialize"):
        self.engine, self.cfg = engine, cfg
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.loader = None            # the TrackedLoader ds_plugins.initialize hands back, if any
        self.checkpointer = None
        self.applied_grad = None      # the session's meter on DeepSpeed's inner optimizer (applied_grad_meter)
        self.scaler_view = ScalerView(engine)
        self.recipe = None            # ds_plugins.precision.Recipe, set by ds_plugins.initialize
        self._framework_batches = 0   # micro-batches of a framework's tagged loader (no epochs known)
        self.entry = entry            # "auto": built by a framework through the zero-code entry (ds_plugins/auto.py)
        if guard_enabled and cfg.detectors.nonfinite.enabled:
            find_strategy(engine.optimizer)  # refuse an unsupported optimizer now, not at step time
        # (the forwards again through the engine's module: localisation, data or weights, peer replay)
        self.replays = ModuleReplays(lambda: self.engine.module, self.rank)
        self.session = GuardSession(self, cfg, self.rank, self.world, guard_enabled=guard_enabled,
                                    device=_collective_device(), localize=self.replays.localize,
                                    replay=self.replays.replay, peer_replay=self.replays.peer_replay,
                                    narrow_rows=engine.zero_optimization_stage() < 3 and getattr(engine, "mpu", None) is None,
                                    hints=FRAMEWORK_HINTS if entry == "auto" else HINTS)
        s = self.session
        self.replays.bind(s)
        self.guard, self.faults, self.heart, self.driver, self._hooks = s.guard, s.faults, s.heart, s.driver, s.hooks
        if self.guard is not None:
            self.guard.attach_model(engine.module)
        if self.faults is not None:
            self.faults.precision = _dtype(engine)  # (the session's after a precision switch: GuardSession.to_bf16)
        self._hook_engine()
        s.arm(float(engine.gradient_clipping() or 0.0))
        if self.guard is not None:
            from ds_plugins.checkpoint import DeepSpeedState

            base = _plain_class(type(engine))
            self.checkpointer = s.start(DeepSpeedState(self, base.save_checkpoint, base.load_checkpoint),
                                        _coords(engine, self.rank), _framework_facts(engine, cfg),
                                        _run_facts(engine, client_scheduler))

    @property
    def watchdog(self):
        return self.session.watchdog

    def surviving(self, call, stale=lambda: None, discard: bool = True):
        """``call()``, a rank's death survived (trainguard.liveness.replacement; ds_plugins.inprocess)."""
        from ds_plugins.inprocess import replace_lost_rank

        return surviving(self.world if self.rebuild else None, call,
                         lambda why: replace_lost_rank(self, why, discard), stale)

    def after_load(self) -> None:
        """After initialize and after every checkpoint load: the guard owns the fp16 scaler's floor."""
        if self.guard is not None and self.cfg.detectors.loss_scale.enabled:
            self.scaler_view.arm()

    def step_number(self) -> int:
        """The optimizer step being computed (1-based, as logged): while one is applied, that one -- a DECIDE after
        DeepSpeed's own skip counted it (trainguard.step.launchgate) replays it as it was."""
        applying = self.driver.applying if self.driver is not None else None
        return applying if applying is not None else self.engine.global_steps + 1

    # ------------------------------------------------------------------ setup
    def _hook_engine(self) -> None:
        """What the adapter puts on the engine: fault hooks, gradient hooks, the fp16 scaler's arming. At attach,
        and again after the engine was rebuilt in place (bf16 fallback; the session arms the rest again)."""
        if self.faults is not None:
            self._hooks += self.faults.install_module_faults(self.engine.module, self.step_number)
        self._install_grad_hooks()
        self.after_load()
        self.session.scale_in_scheduler(self.engine.lr_scheduler)  # (a closed-form one: a lowered LR is what it says)

    def _install_grad_hooks(self) -> None:
        from trainguard.ports import install_grad_hooks

        named = [(n, p) for n, p in self.engine.module.named_parameters() if p.requires_grad]
        check = self.guard is not None and self.cfg.detectors.nonfinite.enabled and \
            self.cfg.detectors.nonfinite.check_grads
        clamp = self.session.value_bound() is not None  # (a clip by value turns an Inf finite: hooks, check first)
        points, self._divisor = _reduction_points(self.engine) if not clamp else ([], None)
        add, add_all = self.session.grad_checks if check else (None, None)
        self._hooks += install_grad_hooks(named, self.faults, self.step_number, add, [self._clamp_grad] if clamp else
                                          [], points, add_all)  # (clipping by value: last)

    def _clamp_grad(self, grad):
        # the hook sees loss-scaled gradients divided by the accumulation steps: scale the bound alike
        bound = self.session.value_bound() * _loss_scale(self.engine) / self.engine.gradient_accumulation_steps()
        return grad.clamp(-bound, bound)

    # ------------------------------------------------------------------ loop points
    def forward(self, base_forward, inputs, kwargs):
        step = self.step_number()
        inputs, kwargs, ids, rejected = take_tags(inputs, kwargs)
        if ids is not None and self.engine.module.training:  # a framework's loader, tagged (trainguard.data.sample_tags)
            self._framework_batches += 1
            self.on_batch(ids, DataPosition(epoch=-1, batch_in_epoch=self._framework_batches,
                                            consumed_samples=int(getattr(self.engine, "global_samples", 0))),
                          [tuple(r) for r in rejected])
        (inputs, kwargs), poison_output = self.session.forward(step, (inputs, kwargs))
        if self.guard is not None and self.engine.module.training and (
                self.cfg.detectors.localize.enabled or self.session.replays.wants_batches):
            # (references, not copies: what a replay of this micro-batch needs, trainguard.replay.replay)
            self.session.replays.record((inputs, kwargs, poison_output), rows_of((inputs, kwargs)))
        # a peer replays the step's last micro-batch (detectors.peer_replay): from the RNG state this forward starts
        # from, to compare with what this forward computes
        measure = self.guard is not None and self.engine.module.training and \
            self.session.replays.peer_sampled(step) and self.engine.is_gradient_accumulation_boundary()
        rng = rng_state() if measure else None
        # the poison hook first, so that the probes see what it did
        with (PoisonFirstLeaf(self.engine.module, poison_output) if poison_output else contextlib.nullcontext()), \
                self.session.probing(step):
            out = base_forward(*inputs, **kwargs)
        if measure:
            self.session.replays.measured(rng, output_value(out))  # (device values: read at DECIDE)
        if self.engine.module.training:
            self.session.forward_done()  # (the step's own time: the straggler detector, trainguard.step.steptime)
        return out

    def on_batch(self, sample_ids, position, rejected=()) -> None:
        if self.guard is not None:
            self.guard.on_batch(sample_ids, position, rejected)

    def sample_hook(self, samples):
        """Loader-level faults (bad_label), before the sanitiser sees the samples."""
        s = self.cfg.sanitize
        out_of_range = s.vocab_size if s.vocab_size is not None else 1_000_000
        return self.faults.samples(self.step_number(), samples, s.label_key, out_of_range)

    # ------------------------------------------------------------------ trainguard.step.driver.Framework
    @property
    def data(self):
        return self.loader

    def completed_steps(self) -> int:
        return self.engine.global_steps

    def scaler(self):
        return self.scaler_view if self.scaler_view.active() else None

    def agree_scale(self) -> tuple[float, float]:
        return _loss_scale(self.engine), self._divisor or float(self.engine.gradient_accumulation_steps())

    def applied_grad_meter(self):
        return _applied_grad_meter(self.engine)

    def set_clip(self, max_norm: float) -> None:
        """Hand a max-norm to DeepSpeed's own clipping (it clips inside the optimizer's step, on the
        partitioned gradients, with the global norm it computes anyway)."""
        eng = self.engine
        eng._config.gradient_clipping = max_norm
        if hasattr(eng.optimizer, "clip_grad"):
            eng.optimizer.clip_grad = max_norm

    def apply(self, decision, ds_step) -> StepOutcome:
        eng = self.engine
        own_norm = None
        if decision.action in (Action.SKIP_STEP, Action.ROLLBACK):
            with forced_skip(eng.optimizer):
                result = ds_step()
        else:
            if self._ds_has_no_norm():
                # ZeRO-0 fp32 with a torch optimizer: DeepSpeed computes no global norm. The reduced
                # gradients are in .grad until the step clears them; take the norm now (on device).
                grads = [p.grad for p in eng.module.parameters() if p.grad is not None]
                own_norm = torch.nn.utils.get_total_norm(grads) if grads else None
            result = ds_step()
        applied = eng.was_step_applied()
        norm = eng.get_global_grad_norm() if applied else None
        if norm is None and applied:
            norm = own_norm
        return StepOutcome(result, applied, norm, float(eng.gradient_clipping() or 0.0))

    def launch_gate(self) -> LaunchGate | None:
        """Where DeepSpeed's step ends in one torch optimizer's launch, nothing changed on the decision's behalf before
        it (trainguard.step.launchgate): ZeRO 0-2 without offload, bf16 or fp32 (the driver leaves fp16's dynamic
        scale and adaptive clipping out). A refused update takes DeepSpeed's own skip bookkeeping: the optimizer says
        ``overflow``, the engine counts the step as skipped and leaves the scheduler alone."""
        eng, opt = self.engine, self.engine.optimizer
        if getattr(self, "_launch", (None, None))[0] is opt:  # (made once for the optimizer the engine has)
            return self._launch[1]
        self._launch = (opt, None)
        if eng.fp16_enabled() or eng.zero_optimization_stage() > 2 or eng.zero_cpu_offload() or \
                getattr(eng, "torch_autocast_z0_gradscaler", None) or getattr(opt, "torch_autocast_gradscaler", None) \
                or getattr(opt, "zenflow", False):
            return None
        self._launch = (opt, LaunchGate.at(opt, GATED, "overflow"))
        return self._launch[1]

    def lr_groups(self) -> list[dict]:
        return self.engine.optimizer.param_groups

    def after_rollback(self, step: int) -> dict:
        # (your DeepSpeed loop rewinds with the engine's global_steps, back with the checkpoint; HF's Trainer and
        # Accelerate's loops cannot: the engine and its LR schedule go on with them -- trainguard.recovery.lrapply.goes_on)
        return goes_on(self.engine, "global_steps", self.engine.lr_scheduler, step) if self.entry == "auto" else {}

    def skipped_steps(self) -> int:
        return self.engine.skipped_steps

    def reset_moments(self) -> int:
        return zero_adam_moments(getattr(self.engine.optimizer, "optimizer", self.engine.optimizer))

    def fallback_to_bf16(self, step: int) -> dict:
        from ds_plugins.precision import fallback_to_bf16

        if self.entry == "auto":
            raise FallbackUnavailable(
                "the engine was built by a framework (HF Trainer / Accelerate), whose optimizer and scheduler wrappers "
                "would keep pointing at the fp16 engine's; restart from the newest checkpoint with bf16 enabled in "
                "your ds_config (or leave bf16_fallback out of recovery.ladders.loss_scale)")
        return self._rebuilt(lambda: fallback_to_bf16(self.engine, self.recipe))

    def _rebuilt(self, rebuild) -> dict:
        """Run ``rebuild`` (which replaces the engine's state in place), then guard the new state:
        the user's engine object keeps its identity, its class and this adapter."""
        self.session.remove_hooks()
        engine = self.engine
        cls = type(engine)
        detail = rebuild()
        object.__setattr__(engine, "_trainguard", self)
        engine.__class__ = cls
        self.scaler_view = ScalerView(engine)
        self._hook_engine()
        return detail

    def _ds_has_no_norm(self) -> bool:
        eng = self.engine
        return not (eng.zero_optimization() or eng.bfloat16_enabled() or eng.fp16_enabled())

    # ------------------------------------------------------------------ liveness and the end

    def close(self) -> None:
        self.session.close({"deepspeed_skipped_steps": self.engine.skipped_steps,
                            "global_steps": self.engine.global_steps})


def attach(engine, cfg: TrainguardConfig, guard_enabled: bool = True, client_scheduler=None,
           entry: str = "initialize") -> EngineGuard:
    """Guard an existing engine in place. Returns the adapter state (also ``engine._trainguard``)."""
    state = EngineGuard(engine, cfg, guard_enabled=guard_enabled, client_scheduler=client_scheduler, entry=entry)
    # nn.Module.__setattr__ would try to register modules; this is a plain attribute.
    object.__setattr__(engine, "_trainguard", state)
    engine.__class__ = _guarded_class(type(engine))
    return state

