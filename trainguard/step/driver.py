"""THE step sequence, written once for every framework.

    AGREE -> DECIDE -> apply/skip (STEP) -> END -> rollback / loss-scale remedy -> health marks,
    periodic snapshot -> goodput

An adapter (``ds_plugins``, ``megatron_hooks``) calls :meth:`StepDriver.step` from the place its
framework takes an optimizer step (DeepSpeed's ``engine.step()`` at the accumulation boundary,
megatron's ``optimizer.step()``) and implements :class:`trainguard.protocols.Framework`: how to apply or skip a step
there, its loss-scaler view, its LR groups, its optimizer moments, its precision fallback, its
checkpointer (a :class:`trainguard.checkpoint.manager.CheckpointManager`) and, where the adapter
owns the data loader, the data position. Everything else -- the order of the loop points, when to
roll back and what to set aside, the LR cooldown, the ladder's remedies, the records written, the
goodput accounting -- lives here, once, so that both frameworks behave the same from one block.
The loop's pseudocode is :class:`trainguard.events.Event`'s docstring.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator

from trainguard import decisions

from trainguard.recovery import degrade, room, scale_remedy
from trainguard.prevent.clipping import Clipper
from trainguard.config import TrainguardConfig
from trainguard.events import Action, Anomaly, Record
from trainguard.step.guard import StepGuard
from trainguard.recovery.lrapply import first_lr, scaled_lr
from trainguard.ranks.isolation import all_true
from trainguard.faults.injector import FaultInjector
from trainguard.observe.goodput import GoodputMeter
from trainguard.recovery.policy import Decision, Policy
from trainguard.protocols import Framework


_AT_LAUNCH = Decision(Action.CONTINUE, "decided at the update's launch")


class StepDriver:
    """One per rank. ``heart``: trainguard.liveness.watchdog.Heartbeat."""

    def __init__(self, fw: Framework, guard: StepGuard, cfg: TrainguardConfig, heart, policy: Policy,
                 goodput: GoodputMeter, faults: FaultInjector, clipper: Clipper, to_bf16: Callable[[int], dict]):
        self.fw, self.guard, self.cfg, self.heart = fw, guard, cfg, heart
        # (the guard's too: trainguard.step.session)
        self.policy, self.goodput, self.faults, self.clipper = policy, goodput, faults, clipper
        self.to_bf16 = to_bf16  # (the session's: the framework's fallback, then what depends on the precision re-armed)
        self.step_lr: float | None = None  # the LR this step's update used, when the driver scaled it
        self.applying: int | None = None   # the step whose update the framework is applying (its scheduler sets the next)
        self.gating, self.taken = False, 0  # (every rank has the update's launch: point(); steps this process took)

    # ------------------------------------------------------------------ the step
    def step(self, base_step: Callable[[], Any]) -> Any:
        fw, guard = self.fw, self.guard
        step = fw.completed_steps() + 1
        self.heart.beat("collective", step)
        scaler = fw.scaler()
        before = scaler.state() if scaler is not None else None
        meter = getattr(fw, "applied_grad", None)
        with self._lr_scaled(step):
            loss_scale, divisor = fw.agree_scale()
            lr = guard.lr_now = self.step_lr if self.step_lr is not None else first_lr(fw.lr_groups())  # (the table's)
            # (a process's first step at its start: no optimizer state yet to leave as it was)
            gate = self.fw.launch_gate() if self.taken and self._gating(before is not None) else None
            read = guard.on_agree(step, loss_scale=loss_scale, grad_divisor=divisor, dynamic_scale=before is not None,
                                  late=True)
            seen = {}

            def decide() -> Decision:
                view = seen["obs"] = read()
                if gate is not None and guard.clear(step, view) and not self.faults.forcing(step):
                    if meter is not None and step % self.cfg.metrics.every_steps == 0:
                        meter.arm()  # (a clear step launches first, its DECIDE after: trainguard.step.launchgate)
                    seen["late"] = True
                    return _AT_LAUNCH
                guard.agreed(view)
                seen["decision"] = self._decided(step, view, before, meter)
                if seen["decision"].action is Action.ABORT:  # (nothing applied: at the launch too, before it)
                    raise guard.abort(step, seen["decision"])
                return seen["decision"]

            self.applying = step
            try:
                if gate is None:
                    decide()
                    limit = self.clipper.max_norm()  # (the max-norm for the coming step; None: leave the framework's)
                    if limit is not None and self.cfg.clipping.mode == "adaptive":
                        fw.set_clip(limit)
                    out = fw.apply(seen["decision"], base_step)
                else:  # (a refused update takes the framework's skip path at the launch: trainguard.step.launchgate)
                    out = gate.run(decide, lambda: fw.apply(_AT_LAUNCH, base_step))[0]
                    if seen.get("late"):
                        guard.agreed(seen["obs"])
                        seen["decision"] = self._late(step, seen["obs"], before)
            finally:
                self.applying = None
        obs, decision = seen["obs"], seen["decision"]
        late_rollback = seen.get("late") and decision.action is Action.ROLLBACK  # (its update applied, then rolled back)
        scale_decision = guard.on_step(step, _AT_LAUNCH if late_rollback else decision, out.applied, before)
        guard.on_end(step, obs, {
            "grad_norm": out.grad_norm, "clip_limit": out.clip_limit,
            "applied_grad_sq": meter.take() if meter is not None else None,
            "lr": lr,  # (this update's: a skipped step's scheduler may already have set the next one's)
            "loss_scale": before.scale if before is not None else 1.0,
            "loss_scale_min": before.min_scale if before is not None else None,  # (the floor alert's other half)
            "skipped_steps": fw.skipped_steps(),
            "applied": out.applied, "action": decision.action.value, "goodput": self.goodput.ratio(),
            # (monotonic in a process, unlike the framework's skipped count, which a rollback's load sets back)
            "executed_steps": self.goodput.executed + 1,
            "not_applied_steps": self.goodput.skipped + (not out.applied)})
        acting = scale_decision or decision
        if acting.action is Action.ABORT:
            raise guard.abort(step, acting)
        rolled_back = acting.action is Action.ROLLBACK and self.rollback(step, acting)
        if not rolled_back:  # (a rollback that happened re-runs from its checkpoint)
            self._after_step(step, obs, decision)
        self.goodput.step_done(step, out.applied and not rolled_back)
        self.taken += 1
        self.heart.beat("data", fw.completed_steps())
        return out.result

    def _gating(self, scaled: bool) -> bool:
        """Whether a step waits for the update's launch (trainguard.step.launchgate): every rank's adapter has one, and
        not under fp16's dynamic scale or adaptive clipping (state set on the decision's behalf before the launch)."""
        return self.gating and not scaled and self.cfg.clipping.mode != "adaptive"

    def point(self) -> dict:
        """BEGIN, every rank: whether every rank's adapter has the launch (agreed: decided at different points, the
        ranks' collectives would cross), and run_start's ``decided_at`` saying where a healthy step is decided."""
        fw = self.fw
        self.gating = all_true(hasattr(fw, "launch_gate") and fw.launch_gate() is not None)
        return {"decided_at": "the update's launch" if self._gating(fw.scaler() is not None) else "the step's start"}

    def _late(self, step: int, obs, before) -> Decision:
        """DECIDE after a clear step's update launched (trainguard.step.launchgate): what it finds is one step late --
        an abort is raised now, a rollback discards the update, a skip cannot be: the update stays, and says so."""
        decision = self._decided(step, obs, before, None)
        if decision.action is Action.ABORT:
            raise self.guard.abort(step, dataclasses.replace(
                decision, reason=decision.reason + " (decided after its update's launch: that update applied)"))
        if decision.action is Action.SKIP_STEP:
            return dataclasses.replace(decision, action=Action.CONTINUE,
                                       reason=decision.reason + " (decided after its update's launch: applied)")
        return decision

    def _decided(self, step: int, obs, before, meter) -> Decision:
        """DECIDE, and what the decision asks before the update: a forced action (fuzzing), the culprit samples set
        aside, the applied-gradient meter armed where this step's line is due."""
        guard = self.guard
        decision = guard.on_decide(step, obs)
        if decision.action in (Action.CONTINUE, Action.SKIP_STEP) and self.cfg.faults:  # (force_action: fuzzing)
            forced = self.faults.forced_action(step)
            if forced is not None:
                decision = decisions.forced(forced, step, self.cfg.recovery.lr_factor, fp16=before is not None)
                guard.emit(step, Record.FAULT_INJECTED, [], decision.action.value, {"faults": [
                    {"type": "force_action", "step": step, "action": forced}], "reason": decision.reason})
        fw = self.fw
        if decision.action is not Action.ABORT and fw.data is not None and fw.rank in guard.culprit_samples:
            fw.data.set_aside(guard.culprit_samples[fw.rank])  # never read again (a skip's or a rollback's)
        if meter is not None and guard.line_due(step):
            meter.arm()  # (the line written for this step says what the update really used)
        return decision

    def _after_step(self, step: int, obs, decision: Decision) -> None:
        """Checkpoint health (stable marks, post-save trajectory, resume check), periodic saves and
        the corrupt_checkpoint fault."""
        cp = self.fw.checkpointer
        if cp is None:
            return
        # fp16 overflows are the scaler's routine, not a sign that the checkpoint is unhealthy; nor is bad data
        # whose steps were skipped (the replay found the weights healthy: trainguard.replay.replay)
        blamed_data = decision.action is Action.SKIP_STEP and self.guard.weights == "healthy"
        cp.on_step_end(step, obs.summary.finite_loss, anomaly=not blamed_data and any(v.anomaly != Anomaly.OVERFLOW
                                                                               for v in decision.verdicts))
        cp.after_step(step)

    # ------------------------------------------------------------------ the LR
    def lr_multiplier(self, step: int) -> float:
        """What trainguard multiplies step ``step``'s scheduled LR by: (lr_ramp fault) x (recovery's lowered LR, during
        its cooldown)."""
        mult = self.faults.lr_multiplier(step) if self.cfg.faults else 1.0
        return mult * self.policy.lr_applied(step - 1)  # (1.0 unless a lowering's cooldown runs)

    @contextlib.contextmanager
    def _lr_scaled(self, step: int) -> Iterator[None]:
        """The LR for this step's update x :meth:`lr_multiplier`; afterwards the scheduled LR is put back (unless the
        scheduler set a new one). Not where the scheduler itself applies it (:func:`schedule_scaled`)."""
        mult = self.lr_multiplier(step)
        self.step_lr = None
        if mult == 1.0 or getattr(self.fw, "lr_scaled_by_scheduler", False):
            yield
            return
        with scaled_lr(self.fw.lr_groups(), mult) as lr:
            self.step_lr = lr
            yield

    def _lr_changed(self) -> None:
        """Where the framework's scheduler applies trainguard's multiplier, it sets the lowered LR now."""
        refresh = getattr(self.fw, "lr_scaled_by_scheduler", None)
        if callable(refresh):
            refresh()

    # ------------------------------------------------------------------ recovery
    def rollback(self, step: int, decision: Decision) -> bool:
        """In-process rollback, on every rank together: load the chosen checkpoint (RNG with it),
        keep the data position where it is and move it ``skip_batches`` further, quarantine the
        culprit rank's samples, lower the LR if asked. The user's loop just goes on.

        A ``loss_scale`` decision (the fp16 scaler collapsed) skips no batches -- the data is not
        to blame -- and then applies its remedy: reset the scale, raise its floor, or continue in
        bf16 (in place when no checkpoint predates the descent). Returns whether one was loaded."""
        fw, guard, rc = self.fw, self.guard, self.cfg.recovery
        # (a loss_scale decision, or a non-finite fp16 forward sent to bf16: the data is not to blame)
        scale_case = decision.anomaly is Anomaly.LOSS_SCALE or decision.remedy is not None
        skip = 0 if scale_case else rc.skip_batches
        quarantined = guard.culprit_samples   # (set aside in the loader when the step was decided)
        data = fw.data
        cp = fw.checkpointer
        root = cp.rollback_root() if cp is not None else None
        if cp is not None:
            cp.wait_pending()  # (a save still being written is no target yet: the first step's, with async saves)
        scale, restart, tag = decision.lr_scale, decision.restart, None
        if restart:  # a young run whose LR was too high from the start (trainguard.recovery.lrcut)
            first, tag, _ = cp.first_target() if root is not None else (None, None, None)
            if tag is not None:
                root, why = first, "the first step's checkpoint: the run's LR was too high from its start"
            else:  # (none -- or no checkpoint.dir at all: an ordinary rollback, the ordinary cut, for the cooldown: a
                # tenth from damaged weights is too slow, and kept for good it would compound)
                decision = decision.as_ordinary(rc.lr_factor, "; but no first step's checkpoint: an ordinary rollback")
                scale, restart = decision.lr_scale, False
        mode = decision.target or rc.rollback_to
        if tag is None:
            tag, why, at = (None, "no checkpoint directory: set trainguard.checkpoint.dir", -1) if root is None else \
                cp.rollback_target(root, decision.onset_step or step, mode, inclusive=decision.onset_skipped)
            if tag is not None and (kept := room.keeps_progress(cp, decision, step, at, guard.weights)):
                tag, why = None, kept  # (a creep whose going back costs more than the run has left: every rank agrees)
        failures: list[dict] = []
        if tag is not None:  # (a target that fails to load: the next, or on where we are -- trainguard.recovery.degrade)
            position = data.state_dict() if data is not None else None
            cp.wait_pending()
            decision, root, tag, why, failures = degrade.rollback_load(cp, guard, fw, decision, step, root, tag, why,
                                                                       mode, rc.lr_factor)
            scale, restart = decision.lr_scale, decision.restart
        if tag is None:
            if decision.lower_lr:  # (in place; an expired factor was forgotten when this step's LR was set)
                self.policy.lower_lr(scale, until=fw.completed_steps() + rc.lr_cooldown_steps,
                                     lasting=decision.lasting)
                guard.lr_lowered()
                self._lr_changed()
            remedy = self.scale_remedy(step, decision, rolled_back=False) if scale_case else None
            self.policy.rollback_unavailable(step, None if decision.lower_lr else decision.anomaly)
            guard.emit(step, Record.ROLLBACK_UNAVAILABLE, [], Action.SKIP_STEP.value, {
                "reason": why, "anomaly": decision.anomaly, "onset_step": decision.onset_step,
                **({"failed_targets": [f["to_tag"] for f in failures]} if failures else {}),
                "lr_factor": self.policy.lr_factor if decision.lower_lr else None,
                "quarantined": {str(r): ids for r, ids in quarantined.items()}, "remedy": remedy})
            return False
        to_step = fw.completed_steps()           # the checkpoint's step
        loop = fw.after_rollback(step)           # a loop that cannot rewind goes on at ``step``: what it kept
        goes_on = fw.completed_steps()
        self.goodput.rollback(to_step)
        if data is not None:
            data.load_state_dict(position)       # where we were, quarantine included ...
            data.skip(skip)                      # ... and then some
        abandoned = cp.abandon_after(cp.rollback_root(), to_step)
        # (a restart in bf16 is not the LR's unless it cut the LR too: a later climb may still restart, once)
        self.policy.rolled_back(step, decision.lower_lr, {"to_tag": tag, "to_step": to_step,
                                                           "restart": restart and (not scale_case or decision.lower_lr),
                                                           "anomaly": decision.anomaly}, scale=scale,
                                 until=goes_on + rc.lr_cooldown_steps, lasting=decision.lasting)
        self._lr_changed()  # (the loaded optimizer's LRs were the checkpoint's: the scheduler's, x the factor now)
        zeroed = fw.reset_moments() if rc.reset_optimizer_moments else None
        guard.rewound(step, to_step, restart=restart)
        guard.emit(step, Record.ROLLBACK, sorted(quarantined), Action.ROLLBACK.value, {
            "to_tag": tag, "to_step": to_step, "why": why, "anomaly": decision.anomaly,
            "onset_step": decision.onset_step, "skip_batches": skip if data is not None else 0,
            "position_after": data.position.as_dict() if data is not None else None,
            "quarantined": {str(r): ids for r, ids in quarantined.items()}, "abandoned": abandoned,
            "lr_factor": self.policy.lr_factor if decision.lower_lr else None,
            "optimizer_moments_reset": rc.reset_optimizer_moments, "reason": decision.reason,
            **({"from_first_step": str(root)} if restart else {}),
            **({"moments_zeroed": zeroed} if zeroed is not None else {}),
            **({"loop": loop} if loop else {})})
        if scale_case:
            self.scale_remedy(step, decision, rolled_back=True)  # (its precision change saves a checkpoint)
            if restart and fw.checkpointer is not None:
                fw.checkpointer.refresh_first()  # (in the precision the run goes on in)
        elif restart:
            cp.after_restart()
        return True

    def scale_remedy(self, step: int, decision: Decision, rolled_back: bool) -> dict:
        """The loss_scale rung's remedy (trainguard.recovery.scale_remedy)."""
        return scale_remedy.carry_out(self, step, decision, rolled_back)
