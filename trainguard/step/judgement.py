"""DECIDE's second half and STEP's check, the same on every rank: from the step's verdicts to one decision
(trainguard.recovery.policy), and who is to blame -- the culprit samples (the driver sets them aside), the ranks whose own
loss failed with them and the stragglers that persist (their hosts: trainguard.recovery.suspects) --; at STEP, whether the
framework did what was decided, and whether the fp16 loss scale collapsed (the ``loss_scale`` ladder's decision).

What it judges is gathered first (DECIDE's first half: trainguard.step.evidence); what it finds is written by the step's
log (trainguard.observe.steplog), in the order the records always had.
"""
from __future__ import annotations

import math
from dataclasses import replace

from trainguard.ranks.attribution import culprit_samples
from trainguard.detectors.loss_scale import LossScaleWatch
from trainguard.detectors.registry import Decide
from trainguard.detectors.straggler import StragglerDetector
from trainguard.events import Action, Remedy
from trainguard.recovery.lrcut import LrHistory, held_at_floor
from trainguard.recovery.policy import Decision, Policy
from trainguard.replay.replays import Replays
from trainguard.observe.steplog import StepLog
from trainguard.recovery.suspects import SuspectWatch
from trainguard.verdicts import ScalerState


class Judgement:
    """One per rank (the guard's). ``stats``: the loss and gradient statistics (a rise's onset, the ranks whose loss
    is not healthy); ``replays``: this step's weights check (data or weights)."""

    def __init__(self, cfg, policy: Policy, stats, lr_history: LrHistory, replays: Replays, suspects: SuspectWatch,
                 log: StepLog):
        self.cfg, self.policy, self.stats, self.lr_history = cfg, policy, stats, lr_history
        self.replays, self.suspects, self.log = replays, suspects, log
        self.loss_scale = LossScaleWatch(cfg.detectors.loss_scale)
        self.straggler = StragglerDetector(cfg.detectors.straggler)
        self.skipped_steps = 0                       # steps the guard skipped (the framework's own count is separate)
        self.last: Decision | None = None            # the last step's decision
        self.culprit_samples: dict[int, list[int]] = {}  # {rank: the samples it is to blame for} of the last step
        self.recent_anomalies: list = []             # [step, anomaly] of recent verdicts (a checkpoint's health)
        self.everyone: dict | None = None            # the last step's object gather ({rank: values}; an abort's report)
        self._restart_refused = self._rise_refused = False  # this decision's restart refused for want of room

    def decide(self, step: int, ctx: Decide, everyone: dict | None, scaled: bool, summary_way: bool) -> Decision:
        """The policy's one action over the step's verdicts (``ctx``, with the object gather ``everyone``), the blame,
        and their records. ``scaled``: an fp16 dynamic loss scale is on; ``summary_way``: the rows did not travel."""
        verdicts = ([ctx.nonfinite] if ctx.nonfinite is not None else []) + ctx.found
        weights = self.replays.weights
        lr_cut, refused = None, self.lr_history.no_room(step)  # (a young run's restart: only where the run has room)
        if self.cfg.recovery.lr_cut == "evidence":
            def lr_cut(onset: int) -> tuple[float, str, bool]:
                cut = self.lr_history.cut(onset, step, self.cfg.recovery.lr_factor)
                if cut[2] and refused:  # (the ordinary cut instead: recovery.lr_factor, expiring with its cooldown)
                    self._restart_refused = True
                    return self.cfg.recovery.lr_factor, "", False
                return cut
        rising, once = self._rising(step), not self.policy.restarted
        decision = self.policy.decide(verdicts, step, self.stats.rise_onset(step), weights=weights, fp16=scaled,
                                      lr_cut=lr_cut, lr_rising=rising)
        # (said only where the policy would have restarted: a first restart, for a climb -- Policy.decide)
        if refused and decision.action is Action.ROLLBACK and (self._rise_refused or self._restart_refused and once
                                                               and decision.anomaly == "slow_rise"):
            decision = replace(decision, reason=f"{decision.reason}; {refused}")
        decision = self._range_cut(step, decision)
        if decision.action is Action.ROLLBACK and math.isfinite(loss := ctx.summary.loss_mean):
            decision = replace(decision, loss=max(loss, self.stats.loss_median() or loss))
        self.last = decision
        # damaged weights, not data: no sample is to blame
        self.culprit_samples = culprit_samples(decision, everyone) if weights != "damaged" else {}
        # (every rank whose own loss was not healthy fails with the culprits: a failure they share names no host;
        # judged on anomaly steps only -- each judgement sorts the loss window)
        unhealthy = self.stats.unhealthy(ctx.view) if verdicts else []
        self.suspects.observe(step, self.culprit_samples, self.log.emit, failing=unhealthy,
                              data_blamed=weights == "healthy")  # (the replay blamed the data: no host is suspect)
        if verdicts:
            self.recent_anomalies = (self.recent_anomalies + [[step, v.anomaly] for v in verdicts])[-20:]
        self.everyone = everyone
        self.log.decided(step, ctx.view, decision, verdicts, everyone, self.skipped_steps, self.replays.check)
        if self.cfg.detectors.straggler.enabled:
            self._stragglers(step, ctx, summary_way)
        return decision

    def _rising(self, step: int):
        """``lr_rising`` for the policy (a young run's bf16 fallback from its first step), false where the run has no
        room for a restart (:meth:`LrHistory.no_room`); :attr:`_rise_refused` says whether that refused one."""
        self._restart_refused = self._rise_refused = False
        room = self.lr_history.no_room(step) is None

        def rising(onset: int) -> bool:  # (the policy asks only where a bf16 fallback would start over: a warmup under
            # way, or a fresh run whose loss climbed above where it began before the trouble -- its LR is what failed)
            young = self.lr_history.rising_into(onset) or self._ranged(onset, step) is not None
            self._rise_refused = self._rise_refused or (young and not room)
            return young and room
        return rising

    def _range_cut(self, step: int, decision):
        """A young run's bf16 start-over from its first step whose loss had climbed above where it began as its LR rose,
        before the fp16 trouble and before the loss trend could speak (:meth:`_ranged`): the LR was too high too, and
        bf16 at the same LR fails the same way without fp16's overflow to say so (held-out draws: a one-step warmup to
        25x fell back in place at its LR, +298% against healthy). The cut is the LR range test's
        (trainguard.recovery.lrcut.LrHistory.range_cut), for the rest of the run; the restart is then the LR's (once a
        run)."""
        if decision.remedy is not Remedy.BF16_FALLBACK or not decision.restart or decision.lower_lr \
                or self.policy.restarted or self.cfg.recovery.lr_cut != "evidence":
            return decision
        cut = self._ranged(decision.onset_step or step, step)
        if cut is None:
            return decision
        (scale, why), floor = cut, self.cfg.recovery.lr_floor
        if self.policy.lr_factor * scale < floor:
            scale, why = held_at_floor(self.policy.lr_factor, floor, why)
        if scale >= 1:
            return decision
        return replace(decision, lower_lr=True, lr_scale=scale, lasting=True,
                       reason=f"{decision.reason}; LR x{scale:.3g}: {why}; for the rest of the run")

    def _ranged(self, onset: int, step: int) -> tuple[float, str] | None:
        """The LR range test's cut for a young run whose loss climbed above where it began before ``onset``
        (trainguard.detectors.early_climb), or None: not young, no such climb, or the LR fell since (no restart then
        either: a start-over comes with its cut)."""
        bottom = self.stats.early_climb(onset) if self.lr_history.young(onset) else None
        return self.lr_history.range_cut(bottom, step) if bottom is not None else None

    def _stragglers(self, step: int, ctx: Decide, summary_way: bool) -> None:
        """Alerts only (no ladder acts on a slow rank); one that stays slow has its host suspected."""
        self.log.stragglers(step, self.straggler.observe_reduced(step, ctx.summary) if summary_way
                            else self.straggler.observe(step, ctx.rows))  # (one view per run, whatever the step)
        for r in self.straggler.persisting(step):
            self.suspects.suspect(step, r, f"a straggler for {self.cfg.detectors.straggler.persist_steps}+ steps",
                                  self.log.emit)

    def state_dict(self) -> dict:
        """What a checkpoint keeps of it (in the guard's state): the skips counted, the ladders' budgets."""
        return {"skipped_steps": self.skipped_steps, "policy": self.policy.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.skipped_steps = int(state["skipped_steps"])
        self.policy.load_state_dict(state["policy"])

    def stepped(self, step: int, decision: Decision, applied: bool, scaler: ScalerState | None) -> Decision | None:
        """STEP: the framework applied the update or not -- as decided (a skip it applied is refused: that optimizer's
        skip path is not supported); with an fp16 dynamic loss scale (``scaler``: as the step began), a collapse
        returns the ``loss_scale`` ladder's decision, else None."""
        if decision.action in (Action.SKIP_STEP, Action.ROLLBACK):
            if applied:
                raise RuntimeError(f"rank {self.log.rank}: step {step} was decided SKIP_STEP but the framework "
                                   "applied it; this optimizer is not supported by the skip path")
            self.skipped_steps += 1
        elif decision.action is Action.CONTINUE and not applied:
            self.log.framework_skip(step)
        if scaler is None or not self.cfg.detectors.loss_scale.enabled:
            return None
        verdict = self.loss_scale.observe(step, scaler, overflowed=not applied)
        if verdict is None:
            return None
        scale_decision = self._range_cut(step, self.policy.decide_loss_scale(verdict, step, lr_rising=self._rising(step)))
        if (refused := self.lr_history.no_room(step)) and self._rise_refused:
            scale_decision = replace(scale_decision, reason=f"{scale_decision.reason}; {refused}")
        self.log.verdict(step, verdict, scale_decision, None, self.skipped_steps, self.replays.check)
        return scale_decision
