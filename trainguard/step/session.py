"""One rank's trainguard, built once for every framework: the only caller of the loop points.

An adapter (``ds_plugins``, ``megatron_hooks``) implements :class:`trainguard.protocols.Framework` --
framework calls only -- and makes one :class:`GuardSession` from it. The session builds the
heartbeat, the guard (detectors, policy, event log), the fault injector, the step driver and the
watchdog, and it is what the adapter's hooks call, in :class:`trainguard.events.Event`'s order::

    session = GuardSession(fw, cfg, rank, world, device=..., localize=..., replay=...)
    ...  the adapter's hooks;  session.arm(framework_clip)    # the clipping, on the framework
    fw.checkpointer = session.start(state, coords, framework_facts, run_facts)   # BEGIN
    session.running(newer_than)                            # the resume (checkpoint.dir), the watchdog
    ...  per micro-batch:  session.batch(...); session.forward(step, inputs); session.loss(step, loss);
         per gradient:     session.backward(grad)             (a tensor hook)
    ...  per step:         session.step(base_step)            AGREE .. END, recovery (trainguard.step.driver)
    session.close(totals)                                     # CLOSE

With ``guard_enabled=False`` the same calls run the configured faults only (plain framework under the
same faults, for drills and comparisons) -- the same faults, fired at the same loop points, on every
framework. What is framework-specific (how a forward is wrapped, where the loss is, how a step is
skipped) stays in the adapter; the order, the heartbeats and the faults do not.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import torch

from trainguard.prevent.clipping import Clipper
from trainguard.config import TrainguardConfig
from trainguard.step.driver import StepDriver
from trainguard.recovery.lrapply import closed_form, scaled_lr, schedule_scaled
from trainguard.events import Action, Phase, Record
from trainguard.faults.injector import FaultInjector
from trainguard.observe.goodput import GoodputMeter
from trainguard.recovery.lrcut import LrHistory
from trainguard.step.guard import StepGuard
from trainguard.recovery.policy import Decision, Policy
from trainguard.replay.replays import check_replayable
from trainguard.support.support import check_hints
from trainguard.protocols import Framework
from trainguard.liveness.watchdog import Heartbeat

_CONTINUE = Decision(Action.CONTINUE, "faults only: no guard")


class GuardSession:
    """Everything trainguard runs on one rank, around one framework (``fw``)."""

    def __init__(self, fw: Framework, cfg: TrainguardConfig, rank: int, world: int, *, guard_enabled: bool = True,
                 device: torch.device | str = "cpu", localize: Callable[[], dict] | None = None,
                 replay: Callable | None = None, narrow_rows: bool = False,
                 replay_peers: Sequence[int] | None = None, peer_replay: Callable | None = None,
                 hints: dict[str, str] | None = None):
        hints = check_hints(hints)  # (the adapter's advice in the core's records and errors)
        # a replay key set where this adapter gives no replay: refused by name, before anything is built
        check_replayable(cfg.recovery, replay, peer_replay, guard_enabled and cfg.detectors.peer_replay.enabled,
                         hints.get("replay"))
        self.fw, self.cfg, self.rank, self.world = fw, cfg, rank, world
        self.heart = Heartbeat(rank)
        self.guard: StepGuard | None = None
        # the parts more than the guard acts on, built here and handed to each that needs them (nothing reaches
        # through the guard to its parts): one fault injector, the recovery policy, the goodput meter, the clipper
        injector = FaultInjector(cfg.faults, rank)
        self.faults = injector if cfg.faults else None
        self.goodput = GoodputMeter() if guard_enabled else None
        self.clipper = Clipper(cfg.clipping) if guard_enabled else None
        self.lr_history = LrHistory.for_trend(cfg.detectors.loss_trend) if guard_enabled else None  # (a young run's)
        # trainguard.replay.replays.Replays: what the adapter hands its micro-batches to (record, measured); its ``book``
        # holds them (the step's, the last healthy one: what an adapter's replay runs)
        self.replays = None
        if guard_enabled:
            policy = Policy(cfg.detectors.nonfinite, cfg.recovery)
            self.guard = StepGuard(cfg, rank, world, group=None, device=device, localize=localize, replay=replay,
                                   narrow_rows=narrow_rows, replay_peers=replay_peers, peer_replay=peer_replay,
                                   policy=policy, goodput=self.goodput, faults=injector, clipper=self.clipper,
                                   hints=hints, lr_history=self.lr_history)
            self.replays = self.guard.replays
            self.driver = StepDriver(fw, self.guard, cfg, self.heart, policy, self.goodput, injector, self.clipper,
                                     self.to_bf16)
        else:
            self.driver = None
        self.watchdog = None   # trainguard.liveness.watchdog.Watchdog, from start_watchdog()
        self.hooks: list = []  # what the adapter registered (anything with .remove()): removed at close
        self.closed = False

    # ------------------------------------------------------------------ BEGIN
    def arm(self, framework_clip: float | None = None) -> None:
        """What the guard puts on the framework's optimizer, once the adapter's hooks are in -- at start, and again
        after a precision switch rebuilt it (:meth:`to_bf16`; ``framework_clip`` None then): the clipping
        (``framework_clip``: what the framework clips at before trainguard touches it, kept for the records; in
        ``clipping.mode: norm`` the guard's max-norm handed to it, ``fw.set_clip``) and the meter of what each update
        applied after that clipping (``fw.applied_grad``, from ``fw.applied_grad_meter()``)."""
        if self.guard is None:
            return
        if framework_clip is not None:
            self.clipper.framework_max_norm = framework_clip
        if self.cfg.clipping.mode == "norm":
            self.fw.set_clip(self.cfg.clipping.max_norm)
        old = getattr(self.fw, "applied_grad", None)
        if old is not None:
            old.remove()
            if old in self.hooks:  # (the adapter's list too: the same object)
                self.hooks.remove(old)
        self.fw.applied_grad = meter = self.fw.applied_grad_meter()
        if meter is not None:
            self.hooks.append(meter)

    def to_bf16(self, step: int) -> dict:
        """The fp16 run turned into a bf16 one in place -- the loss_scale ladder's last rung, or the load of a
        snapshot written after one: the framework's objects by the adapter (``fw.fallback_to_bf16``, which raises
        FallbackUnavailable with advice), then what depends on the precision armed again here -- the fault
        injector's precision, the loss-scale watch (no scale to watch in bf16), the detectors' gradient
        distribution, the clipping and the applied-gradient meter on the rebuilt optimizer. Returns what the adapter
        did."""
        detail = self.fw.fallback_to_bf16(step)
        if self.faults is not None:
            self.faults.precision = "bf16"
        if self.guard is not None:
            self.guard.scaler_reset()
            self.guard.precision_changed()
        self.arm()
        return detail

    def checkpoints(self, state):
        """The core's checkpoint protocol (trainguard.checkpoint.manager: staging, hashes, manifest, signature,
        commit, the memory tier, the conversion cache, sidecars) over the adapter's ``state``
        (trainguard.protocols.State)."""
        from trainguard.checkpoint.manager import CheckpointManager
        from trainguard.liveness.replacement import report_pending  # (the replacements that re-entered this run)

        return CheckpointManager(self.cfg, self.guard, self.heart, state, faults=self.faults, goodput=self.goodput,
                                 lr_history=self.lr_history, on_resume=report_pending)

    def start(self, state, coords, framework: dict[str, Any], facts=None):
        """BEGIN, in the order every adapter needs: the checkpoint manager over ``state`` (returned: the adapter keeps
        it as ``fw.checkpointer``, which BEGIN's records read), then every rank's coordinates, the run_start record
        and the start-of-run checks (``facts``: trainguard.prevent.checks.RunFacts, read after :meth:`arm`)."""
        self.fw.checkpointer = self.checkpoints(state)
        self.begin(coords, framework, facts() if callable(facts) else facts)
        return self.fw.checkpointer

    def begin(self, coords, framework: dict[str, Any], facts=None) -> None:
        """BEGIN: every rank's coordinates, the run_start record, the start-of-run checks."""
        if self.guard is not None:
            from trainguard.step.gradhooks import where  # (run_start says where the local-gradient check runs)
            self.guard.on_begin(coords, {**framework, "grad_check_point": where(self.hooks), **self.driver.point()}, facts)

    def running(self, newer_than: int = 0, resume: bool = True) -> Any:
        """The end of BEGIN, once the adapter's data loader is in place: with ``checkpoint.dir``, what a crash left in
        staging cleared and the newest checkpoint that verifies (or the newest stable one) loaded -- only one newer
        than ``newer_than``, the step the run is at (a checkpoint of the user's own may be newer); ``resume=False``
        where the resume is another's (a trainer's: ds_plugins/auto.py) -- then the watchdog. Returns the resumed
        data state, or None."""
        cp = getattr(self.fw, "checkpointer", None)
        resumed = cp.resume_on_start(newer_than=newer_than) if resume and self.cfg.checkpoint.dir and cp else None
        from trainguard.liveness.replacement import running

        running(self, self.fw.completed_steps(), resume)  # (a supervised job: its groups' ports; a replacement)
        self.start_watchdog()
        return resumed

    def start_watchdog(self) -> None:
        """Heartbeats and hang detection (distributed.watchdog), and the ``restart`` record of a
        restarted attempt (trainguard.liveness.watchdog.Watchdog)."""
        import torch.distributed as dist

        from trainguard.liveness.watchdog import Watchdog

        if self.guard is None or self.watchdog is not None or not dist.is_initialized():
            return
        self.watchdog = Watchdog(self.cfg, self.guard, self.heart, self.rank, self.world, self.fw.completed_steps,
                                 goodput=self.goodput)
        self.watchdog.start()

    def scale_in_scheduler(self, scheduler) -> None:
        """The framework's closed-form LR scheduler applies trainguard's LR multiplier (its log tells the truth);
        another scheduler is left as it is (the driver scales each update's LR, and puts the scheduled one back)."""
        rebuilt = getattr(self.fw, "lr_scaled_by_scheduler", None) is not None  # (again: an engine rebuilt around it)
        self.fw.lr_scaled_by_scheduler = None
        if self.driver is not None and closed_form(scheduler):
            driver = self.driver  # (a scheduler steps inside the update of step N -- DeepSpeed's -- or after it)
            self.fw.lr_scaled_by_scheduler = schedule_scaled(scheduler, lambda: driver.lr_multiplier(
                (driver.applying if driver.applying is not None else self.fw.completed_steps()) + 1))
            if rebuilt:  # (the new engine's scheduler was built afresh and its counter loaded: its LR set now)
                self.fw.lr_scaled_by_scheduler()

    def beat(self, phase: Phase, step: int | None = None) -> None:
        self.heart.beat(Phase(phase).value, step)

    # ------------------------------------------------------------------ what an adapter asks of the guard
    def value_bound(self) -> float | None:
        """``clipping.mode: value``: the bound each local gradient is clamped to (None: not clipping by value)."""
        return self.clipper.value_bound() if self.clipper is not None else None

    def emit(self, step: int, record: Record, ranks=(), action: str | None = None, detail: dict | None = None) -> None:
        """One record of the adapter's (a ``handover``, a precision change at load): the guard's event log, with
        :meth:`trainguard.step.guard.StepGuard.emit`'s arguments."""
        if self.guard is not None:
            self.guard.emit(step, record, ranks, action, detail)

    def mirror(self, make: Callable[[list], Any]) -> None:
        """Another file the records are written to (rank 0; ``make(coords)`` -> a sink with ``write(record)``,
        e.g. Megatron-LM's rerun tracker: megatron_hooks.rerun_tracker)."""
        if self.guard is not None and self.rank == 0:
            self.guard.mirror(make)

    # ------------------------------------------------------------------ micro-batch loop points
    def batch(self, sample_ids, position, rejected=()) -> None:
        """BATCH: this micro-batch's dataset indices (named in verdicts) and data position."""
        if self.guard is not None:
            self.guard.on_batch(list(sample_ids), position, rejected)

    def forward(self, step: int, inputs: Any, batch_faults: bool = True) -> tuple[Any, Any]:
        """FORWARD, before the model runs: the heartbeat, the process faults (kill, hang, slow), and -- with
        ``batch_faults`` -- the batch faults. Returns ``(inputs, poison)``: ``poison`` (or None) is what
        :class:`trainguard.faults.poison.PoisonFirstLeaf` puts into the first module's output."""
        if self.goodput is not None:
            self.goodput.begin_step()
        self.beat(Phase.FORWARD, step)
        if self.faults is not None:
            self.faults.process(step)
        if not batch_faults:
            return inputs, None
        if self.guard is not None:
            return self.guard.on_forward(step, inputs)
        if self.faults is not None:
            return self.faults.batch(step, inputs)
        return inputs, None

    def probing(self, step: int):
        """Around the model's forward: the sampled probes on their steps."""
        return self.guard.probing(step) if self.guard is not None else contextlib.nullcontext()

    def forward_done(self) -> None:
        """After a training forward: the step's own compute time (the straggler detector)."""
        if self.guard is not None:
            self.guard.forward_done()

    def loss(self, step: int, loss):
        """LOSS: the loss backward will see (faults may change it); its finiteness flag, on device."""
        self.beat(Phase.BACKWARD, step)
        if self.guard is not None:
            return self.guard.on_loss(step, loss)
        if self.faults is not None:
            return self.faults.loss(step, loss)
        return loss

    def backward(self, grad) -> None:
        """BACKWARD: a parameter's local gradient (from a tensor hook; :attr:`grad_checks` hands the same out)."""
        self.guard.on_backward(grad)

    @property
    def grad_checks(self) -> tuple:
        """The guard's local-gradient check itself, no chain of calls (trainguard.step.tally.LocalGrads): ``add``, a
        tensor hook's (one gradient), ``add_all``, a framework's reduction point's (trainguard.step.gradhooks)."""
        return self.guard.grad_checks

    # ------------------------------------------------------------------ the step
    def step(self, base_step: Callable[[], Any]) -> Any:
        """AGREE .. END and what follows (trainguard.step.driver), around the framework's ``base_step``.
        Faults only: the step applied as the framework would, under the lr_ramp fault, and the
        step's faults spent."""
        if self.driver is not None:
            return self.driver.step(base_step)
        fw = self.fw
        step = fw.completed_steps() + 1
        self.beat(Phase.COLLECTIVE, step)
        mult = self.faults.lr_multiplier(step) if self.faults is not None else 1.0
        with scaled_lr(fw.lr_groups(), mult) if mult != 1.0 else contextlib.nullcontext():
            out = fw.apply(_CONTINUE, base_step)
        if self.faults is not None:
            self.faults.step_done(step)
        self.beat(Phase.DATA, fw.completed_steps())
        return out.result

    # ------------------------------------------------------------------ CLOSE
    def remove_hooks(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks.clear()

    def close(self, totals: dict[str, Any], clean: bool = True) -> None:
        """CLOSE: the watchdog stopped, the hooks removed, the last save committed (``clean``; a loop that
        raised leaves node memory for the restart and waits for no writer, whose peer may be gone),
        the run_end record written and the logs closed. Idempotent."""
        if self.closed:
            return
        self.closed = True
        try:  # (a watchdog that fails to stop must not cost the hooks' removal, the last save, the run_end)
            watchdog = self.watchdog.stop() if self.watchdog is not None else None
        except Exception as e:  # noqa: BLE001
            watchdog = {"stop_failed": f"{type(e).__name__}: {e}"[:300]}
        self.remove_hooks()
        cp = getattr(self.fw, "checkpointer", None)
        if cp is not None and clean:
            cp.close()
        if self.guard is not None:
            self.guard.on_close({**totals, "goodput": self.goodput.summary(),
                                 **({"watchdog": watchdog} if watchdog else {})})
