"""Verdicts -> one action, with escalation ladders and budgets. Pure: the same inputs give the
same action on every rank (every rank feeds it the same gathered verdicts).

Anomaly classes and their default ladders (the k-th occurrence within ``ladder_window`` steps takes
the k-th entry; the last one repeats):

- ``nonfinite``: skip the step, skip it again, then roll back (3 within 100 steps);
- ``instant_burst``: roll back and skip the window (a bad batch);
- ``slow_rise``: roll back and lower the LR (too high an LR or too short a warmup);
- ``loss_scale`` (the fp16 scaler collapsed, see ``detectors.loss_scale``): roll back and reset the
  scale; then also raise its floor; then continue in bf16 (decided after the step, by
  :meth:`Policy.decide_loss_scale`, since only the step shows whether the scaler overflowed).

``weights`` (trainguard.replay.replay, where the adapter can replay): a non-finite or burst step whose last
healthy micro-batch still replays healthy was bad data -- skipped, never rolled back; one whose replay
is no longer healthy means damaged weights -- rolled back at once.

An fp16 ``overflow`` (gradients overflowed, every loss finite) is the scaler's routine: the step
is skipped and the scaler lowers its scale, outside any ladder.

Budgets: at most ``max_rollbacks`` rollbacks per ``rollback_window`` steps, and the accumulated LR
factor never below ``lr_floor``. Exhausting either trains on as the framework would (``recovery.when_exhausted:
"train_on"``: alerts, a non-finite step still skipped -- a recovery never ends a run its framework would have
finished), or is ABORT with a report of what was tried (``"abort"``, like ``nonfinite.action: "abort"`` or
``max_consecutive`` non-finite steps).
"""
from __future__ import annotations

from collections import defaultdict, deque
from typing import Callable, Sequence

from trainguard.config import NonfiniteConfig, RecoveryConfig
from trainguard.decisions import DATA_OR_WEIGHTS, Decision, anomaly_class, from_forward, onset_of
from trainguard.recovery.lrcut import held_at_floor
from trainguard.verdicts import Verdict
from trainguard.events import Action, Anomaly, Remedy

SEVERITY = {"alert": 0, "skip_step": 1, "rollback": 2, "rollback_lower_lr": 3, "raise_floor": 3,
            "bf16_fallback": 3, "abort": 4}
REMEDY = {"rollback": Remedy.RESET_SCALE, "raise_floor": Remedy.RAISE_FLOOR, "bf16_fallback": Remedy.BF16_FALLBACK}


class Policy:
    def __init__(self, nonfinite: NonfiniteConfig, recovery: RecoveryConfig | None = None):
        self.nonfinite = nonfinite
        self.recovery = recovery or RecoveryConfig(enabled=False)
        self.consecutive_nonfinite = 0
        self.total_nonfinite = 0
        self.history: dict[str, deque] = defaultdict(deque)  # per ladder class: its recent occurrences
        self.rollback_steps: deque = deque()
        # the lowered LR (lr_factor) applies until lr_until; lr_lasting: the part that outlives it (Decision.lasting)
        self.lr_factor, self.lr_until, self.lr_lasting = 1.0, 0, 1.0
        self.tried: list[dict] = []
        self.last_rollback_to: int | None = None    # the step the last rollback returned to ...
        self.last_rollback_from: int | None = None  # ... from this step
        self.unavailable: dict[str, int] = {}       # class -> the step a rollback for it found no checkpoint
        self.restarted = False                      # a young run went back to its first step (once per run)

    def decide(self, verdicts: Sequence[Verdict], step: int = 0, rise_onset: int | None = None,
               weights: str | None = None, fp16: bool = False,
               lr_cut: Callable[[int], tuple[float, str, bool]] | None = None,
               lr_rising: Callable[[int], bool] | None = None) -> Decision:
        """``weights``: what replaying the last healthy micro-batch on the current weights said
        (trainguard.replay.replay): "healthy" (the data was bad: a non-finite or burst step that a rung would
        roll back is skipped instead, since a skipped step did no damage), "damaged" (roll back now,
        whatever the rung), or None (no replay: the ladders as written). ``lr_cut``: given the onset, the LR
        multiplier a lowering should use, why, and whether from the first step's checkpoint (trainguard.recovery.lrcut;
        None: ``recovery.lr_factor``). A restart is proposed once per run. ``lr_rising``: whether the LR was still
        rising into a step (a young run's bf16 fallback then starts over from its first step)."""
        verdicts = tuple(verdicts)
        classes = {c for c in map(anomaly_class, verdicts) if c}
        if "nonfinite" in classes:
            self.consecutive_nonfinite += 1
            self.total_nonfinite += 1
        else:
            self.consecutive_nonfinite = 0
        if not classes:
            return Decision(Action.CONTINUE, "healthy" if not verdicts else "alerts only", verdicts)
        if classes == {"overflow"}:
            ranks = sorted({r for v in verdicts for r in v.ranks})
            return Decision(Action.SKIP_STEP, f"fp16 overflow on rank(s) {ranks}: the loss scaler lowers its scale",
                            verdicts, anomaly=Anomaly.OVERFLOW)
        classes.discard("overflow")
        ranks = sorted({r for v in verdicts if anomaly_class(v) for r in v.ranks})
        if "nonfinite" in classes:
            if self.nonfinite.action == "abort":
                return self._abort(f"non-finite values on rank(s) {ranks}; action is 'abort'", verdicts, step)
            if self.consecutive_nonfinite >= self.nonfinite.max_consecutive:
                return self._abort(f"{self.consecutive_nonfinite} non-finite steps in a row (max_consecutive="
                                   f"{self.nonfinite.max_consecutive}); last on rank(s) {ranks}", verdicts, step)

        # the most severe rung of any present class's ladder
        chosen, driver, onset = "alert", None, step
        for c in sorted(classes):
            rung = self._climb(c, step)
            if not self.recovery.enabled:
                rung = "skip_step" if c == "nonfinite" else "alert"
            if SEVERITY[rung] > SEVERITY[chosen]:
                chosen, driver = rung, c
                onset = self.history[c][0] if c == "nonfinite" else onset_of(verdicts, c, step)
                if c == "slow_rise" and rise_onset:  # (the gradient's creep may have begun before the loss's best)
                    onset = min(onset, rise_onset)
        reason = f"{driver or sorted(classes)[0]} " + (f"on rank(s) {ranks}" if ranks else "on every rank (a trend they share)")
        if weights is not None and self.recovery.enabled and driver in DATA_OR_WEIGHTS:
            if weights == "healthy" and chosen in ("rollback", "rollback_lower_lr"):
                chosen = "skip_step"
                reason += (": the last healthy micro-batch replays healthy on these weights, so the data was bad "
                           "and the skipped steps did no damage: skipped, nothing rolled back")
            elif weights == "damaged" and SEVERITY[chosen] < SEVERITY["rollback"]:
                chosen = "rollback"
                reason += (": the last healthy micro-batch no longer replays healthy on these weights: they are "
                           "damaged, rolling back now")
        if chosen == "abort":
            return self._abort(f"{reason}: the ladder says abort", verdicts, step)
        stuck = self.unavailable.get(driver)
        if driver == "instant_burst" and chosen == "rollback" and stuck is not None and \
                0 <= step - stuck < self.recovery.ladder_window:
            # no checkpoint predated this class's onset a moment ago, so a rollback would skip the step again: the
            # weights (not a batch) are what is wrong, and skipping step after step freezes them where they are
            # (bench/natural: a run whose output logits blew up at step 30 skipped every step until its budget
            # aborted it; plain DeepSpeed trained through it) -- train on, and say so
            return Decision(Action.CONTINUE, f"{reason}: no checkpoint predates its onset (step {stuck}); skipping "
                            "again would freeze the weights: training on (alert)", verdicts, anomaly=driver)
        if chosen in ("rollback", "rollback_lower_lr"):
            exhausted = self._budget_exhausted(reason, verdicts, step, skip="nonfinite" in classes, anomaly=driver)
            if exhausted is not None:
                return exhausted
            lower = chosen == "rollback_lower_lr"
            scale, restart, lasting = None, False, False
            if lower:
                scale, why, restart = lr_cut(onset) if lr_cut is not None else (self.recovery.lr_factor, "", False)
                if restart and (self.restarted or driver != "slow_rise"):
                    # (once: a young run that climbs again after it is halved; only for a climb: a burst says nothing
                    # of the LR)
                    scale, why, restart = self.recovery.lr_factor, "", False
                if lasting := bool(why):  # (sized by the LR's history -- a jump, a young run's peak: the schedule's
                    # LR fails, and back after the cooldown it would fail again)
                    why += "; for the rest of the run (the schedule's own LR failed)"
                floor = self.recovery.lr_floor
                if self.lr_factor * scale < floor:
                    if self.lr_factor * self.recovery.lr_factor < floor:
                        return self._exhausted(f"{reason}: the LR factor would fall below lr_floor {floor}", verdicts,
                                               step, skip="nonfinite" in classes, anomaly=driver)
                    scale, why = held_at_floor(self.lr_factor, floor, why)
                if why:
                    reason += f"; LR x{scale:.3g}: {why}"
            # (every non-finite step was skipped -- unless the weights were damaged before it)
            skipped_onset = driver == "nonfinite" and weights != "damaged"
            last, was_at = self.last_rollback_to, self.last_rollback_from
            if driver in ("instant_burst", "slow_rise") and last is not None and was_at is not None and \
                    0 <= step - last < 2 * (was_at - last) and last <= onset:
                # the last rollback did not hold: a spike again before the run got twice as far past its
                # target as it had been when it rolled back, so the state it returned to was already damaged
                # (e.g. by an LR ramp that began before any detector could see it) -- go further back
                onset, skipped_onset = last, False
                reason += f"; the rollback to step {last} did not hold, going further back"
            remedy = None
            if fp16 and driver == "nonfinite" and self.recovery.fp16_fallback != "none" and from_forward(verdicts) and \
                    any(t.get("anomaly") == "nonfinite" and step - t["step"] < self.recovery.ladder_window
                        for t in self.tried):
                # the fp16 forward overflowed again after a rollback: its range (max 65504) is exceeded by these
                # weights' activations, which no loss scale changes (it scales the backward only) and another
                # rollback to the same weights repeats -- continue in bf16 (fp16 at too high an LR)
                remedy = Remedy.BF16_FALLBACK
                reason += ("; the fp16 forward overflowed again after a rollback: its range is exceeded, no loss "
                           f"scale helps -> {remedy}")
                if not lower and lr_rising is not None and lr_rising(onset):
                    # (a young run starts over in bf16 from its first step: its fp16 trouble began before the newest
                    # checkpoint, and from the first step a later climb can restart again, in bf16)
                    restart = True
                    reason += "; a young run, its LR still rising into the trouble: from its first step"
            return Decision(Action.ROLLBACK, reason, verdicts, lower_lr=lower, onset_step=onset, anomaly=driver,
                            onset_skipped=skipped_onset, remedy=remedy, lr_scale=scale, restart=restart,
                            lasting=lasting)
        if chosen == "skip_step":
            return Decision(Action.SKIP_STEP, reason, verdicts, anomaly=driver)
        return Decision(Action.CONTINUE, reason + " (alert)", verdicts, anomaly=driver)

    def decide_loss_scale(self, verdict: Verdict, step: int, lr_rising: Callable[[int], bool] | None = None
                          ) -> Decision:
        """The fp16 scaler collapsed on this (already skipped) step: the ``loss_scale`` ladder's rung.
        Every rank sees the same scaler (DeepSpeed agrees on overflow across ranks), so every rank
        decides the same."""
        reason = f"loss_scale: {verdict.detail.get('why', 'the fp16 loss scaler collapsed')}"
        if not self.recovery.enabled:
            return self._abort(f"{reason}; recovery is disabled", (verdict,), step)
        rung = self._climb("loss_scale", step)
        if rung in ("alert", "skip_step"):
            return Decision(Action.CONTINUE, reason + f" ({rung})", (verdict,), anomaly=Anomaly.LOSS_SCALE)
        if rung == "abort":
            return self._abort(f"{reason}: the ladder says abort", (verdict,), step)
        if rung == "bf16_fallback" and self.recovery.fp16_fallback == "none":
            return self._abort(f"{reason}: the ladder reached bf16_fallback and recovery.fp16_fallback is 'none'",
                               (verdict,), step)
        exhausted = self._budget_exhausted(reason, (verdict,), step, anomaly=Anomaly.LOSS_SCALE)
        if exhausted is not None:
            return exhausted
        remedy = REMEDY.get(rung, Remedy.RESET_SCALE)  # rollback_lower_lr here means a plain rollback too
        onset = verdict.detail.get("onset_step") or step
        restart = remedy is Remedy.BF16_FALLBACK and lr_rising is not None and lr_rising(onset)
        if restart:
            reason += "; a young run, its LR still rising into the trouble: it starts over in bf16 from its first step"
        return Decision(Action.ROLLBACK, f"{reason} -> {remedy}", (verdict,), lower_lr=rung == "rollback_lower_lr",
                        onset_step=onset, anomaly=Anomaly.LOSS_SCALE, remedy=remedy,
                        onset_skipped=True,  # the descent began with an overflow, which was skipped
                        restart=restart)

    def _climb(self, cls: str, step: int) -> str:
        """Count one occurrence of ``cls`` and return its ladder's rung for it."""
        h = self.history[cls]
        h.append(step)
        while h and h[0] <= step - self.recovery.ladder_window:
            h.popleft()
        ladder = self.recovery.ladders.get(cls) or ["alert"]
        return ladder[min(len(h), len(ladder)) - 1]

    def _budget_exhausted(self, reason: str, verdicts, step: int, skip: bool = False, anomaly=None) -> Decision | None:
        while self.rollback_steps and self.rollback_steps[0] <= step - self.recovery.rollback_window:
            self.rollback_steps.popleft()
        if len(self.rollback_steps) >= self.recovery.max_rollbacks:
            return self._exhausted(f"{reason}: rollback budget exhausted ({len(self.rollback_steps)} rollbacks "
                                   f"within {self.recovery.rollback_window} steps)", verdicts, step, skip, anomaly)
        return None

    def _exhausted(self, reason: str, verdicts, step: int, skip: bool, anomaly) -> Decision:
        """A budget spent: train on as the framework would (a non-finite step still skipped), or abort."""
        if self.recovery.when_exhausted == "abort":
            return self._abort(reason, verdicts, step)
        return Decision(Action.SKIP_STEP if skip else Action.CONTINUE, f"{reason}: training on as the framework "
                        "would, alerts only (recovery.when_exhausted: \"abort\" stops here)", tuple(verdicts),
                        anomaly=anomaly)

    def lr_applied(self, completed: int) -> float:
        """The LR factor applied at this point (its lasting part once the cooldown is over: the expired part is
        forgotten, so a later cut is measured against the LR applied, not multiplied into a factor no longer applied)."""
        if completed >= self.lr_until and self.lr_factor != self.lr_lasting:
            self.lr_factor = self.lr_lasting
        return self.lr_factor

    def lower_lr(self, scale: float | None = None, until: int | None = None, lasting: bool = False) -> float:
        """Scale the accumulated LR factor by ``scale`` (a decision's ``lr_scale``; None: lr_factor) until step
        ``until`` (the cooldown's end), or for the rest of the run when ``lasting``. The floor was checked already."""
        self.lr_factor *= self.recovery.lr_factor if scale is None else scale
        if lasting:  # (the LR the evidence named, against the schedule's: an ordinary cut in cooldown included)
            self.lr_lasting = self.lr_factor
        if until is not None:
            self.lr_until = until
        return self.lr_factor

    def rolled_back(self, step: int, lower_lr: bool, detail: dict, scale: float | None = None,
                    until: int | None = None, lasting: bool = False) -> None:
        """The adapter carried out a rollback: count it against the budget."""
        self.rollback_steps.append(step)
        if detail.get("restart"):
            self.restarted = True
        if detail.get("to_step") is not None:
            self.last_rollback_to, self.last_rollback_from = int(detail["to_step"]), step
        cls = detail.get("anomaly")
        if cls in self.history and self.history[cls]:
            ladder = self.recovery.ladders.get(cls) or []
            if len(self.history[cls]) >= len(ladder):
                # the ladder's top remedy was applied: that episode is over, the next occurrence starts
                # again from the bottom rung (the rollback budget still counts every rollback)
                self.history[cls].clear()
        if lower_lr:
            self.lower_lr(scale, until, lasting)
        self.tried.append({"step": step, "action": "rollback_lower_lr" if lower_lr else "rollback", **detail})

    def rollback_unavailable(self, step: int, cls: str | None) -> None:
        """The adapter found no checkpoint before the onset of a ``cls`` rollback (the step was skipped instead)."""
        if cls:
            self.unavailable[str(cls)] = step

    def tried_also(self, step: int, action: str, detail: dict) -> None:
        """Record a remedy beyond the rollback itself (raise_floor, bf16_fallback) for the abort report."""
        self.tried.append({"step": step, "action": action, **detail})

    def _abort(self, reason: str, verdicts, step: int) -> Decision:
        return Decision(Action.ABORT, reason, tuple(verdicts))

    def state_dict(self) -> dict:
        return {"consecutive_nonfinite": self.consecutive_nonfinite, "total_nonfinite": self.total_nonfinite,
                "history": {k: list(v) for k, v in self.history.items()},
                "rollback_steps": list(self.rollback_steps), "lr_factor": self.lr_factor, "tried": self.tried[-20:],
                "last_rollback_to": self.last_rollback_to, "last_rollback_from": self.last_rollback_from,
                "restarted": self.restarted, "lr_until": self.lr_until, "lr_lasting": self.lr_lasting}

    def load_state_dict(self, state: dict) -> None:
        self.consecutive_nonfinite = int(state["consecutive_nonfinite"])
        self.total_nonfinite = int(state["total_nonfinite"])
        for k, v in state.get("history", {}).items():
            self.history[k] = deque(v)
        self.rollback_steps = deque(state.get("rollback_steps", []))
        self.lr_factor = float(state.get("lr_factor", 1.0))
        self.tried = list(state.get("tried", []))
        self.last_rollback_to = state.get("last_rollback_to")
        self.last_rollback_from = state.get("last_rollback_from")
        self.restarted = bool(state.get("restarted", False))
        # (a checkpoint from before lr_until was kept: its lowered LR was lost at a resume)
        self.lr_until, self.lr_lasting = int(state.get("lr_until", 0)), float(state.get("lr_lasting", 1.0))
