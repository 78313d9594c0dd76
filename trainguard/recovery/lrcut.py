"""How far to lower the LR after a climb it caused: sized by what the LR did, not one fixed factor.

A fixed ``recovery.lr_factor`` (0.5) needs five rungs -- five rollbacks, each re-training the steps it undid --
to bring an LR 30x too high back to sane (bench/natural: the runs ended 24-49% above healthy). The LR's own
history says more:

- **it jumped** (one step's LR >= 1.5x the step before, from 10 steps before the onset until now -- a schedule
  raised on resume): back to the LR before the jump, where the loss was healthy (bench/natural: the raised
  schedule ended 1.8% above healthy instead of 5.9% after two halvings);
- **a young run** (the climb began within twice its LR's first rise -- the warmup --, or within twice the steps
  the loss trend needs before it can speak when the run had no warmup; :meth:`LrHistory.young`: its LR settings
  are what fails there, a peak far too high, a warmup too short; no step count of a corpus decides it): a tenth
  of the LR at the loss's best -- the LR range test's rule (Smith, 2017;
  fastai's ``lr_find``: the LR where the loss stops falling, divided by ten) -- *and a restart* from the run's
  first step's checkpoint (``checkpoint.first_step``), once. The restart is what makes the cut work: a rollback to
  the first periodic save lands on weights the too-high LR had already pushed away, and from there a sane LR walks
  them back about ten times slower than they were pushed (measured on bench/natural's warmup of one step: +155%
  against healthy where halvings gave +49%). Without that checkpoint (or a second time): ``recovery.lr_factor``.
  Nor where the loop's count goes on through a rollback and the restart would throw away more steps than the run
  has left (:meth:`LrHistory.no_room`: the run ends further back than it was).
  (A young run's bf16 fallback whose trouble began while the LR was still rising -- a warmup under way -- starts
  over from the same checkpoint and saves it again in bf16: trainguard.recovery.policy, trainguard.step.driver);
- otherwise: ``recovery.lr_factor``, as before.

Never less of a cut than ``lr_factor`` (where the evidence names a milder one, ``lr_factor`` it is, and no evidence is
said: the cut is the ordinary one, and expires with its cooldown). Pure: the guard hands it the LRs it recorded (rank 0's, from the AGREE
table, so every rank computes the same cut).
"""
from __future__ import annotations

import math
from collections import deque

from trainguard.decisions import SETTLE, YOUNG

JUMP = 1.5       # one step's LR over the step before: a jump
BEFORE = 10      # steps before the onset a jump may have come (the loss answers an LR jump within a few steps)
TENTH = 0.1      # the LR range test's back-off from the LR where the loss stopped falling
RISING, RAMP = 1.2, 32  # the LR at an onset over the LR RAMP steps before it: a warmup still under way


def held_at_floor(factor: float, floor: float, why: str) -> tuple[float, str]:
    """The cut that brings the accumulated LR ``factor`` to ``recovery.lr_floor`` instead of below it, and why."""
    return floor / factor, (why + "; " if why else "") + f"held at lr_floor {floor}"


class LrHistory:
    """The LR each recent step's update used (rank 0's)."""

    def __init__(self, maxlen: int = 256, settle: int = SETTLE):
        self.steps: deque[tuple[int, float]] = deque(maxlen=maxlen)
        self.agreed: float | None = None  # this step's LR as every rank reads it (None: unknown)
        self.settle = settle
        self.last_rise = 0                # the newest step whose LR rose above every LR before it (the first rise's)
        self.ramp_end: int | None = None  # the last step of the LR's first rise, once it held RAMP steps (frozen)
        self.peak = 0.0                   # the highest LR of the first rise so far
        self.last_step: int | None = None  # the loop's last step, where its count goes on through a rollback

    @classmethod
    def for_trend(cls, trend) -> "LrHistory":
        """Young measured in the steps the loss trend (``detectors.loss_trend``) takes to speak."""
        return cls(settle=trend.settle)

    def agree(self, lr: float) -> float | None:
        """The step's LR, rank 0's from the AGREE table -- never this rank's own: under pipeline parallelism a
        stage's first param group may hold another LR, and the ranks would classify differently."""
        self.agreed = lr if math.isfinite(lr) else None
        return self.agreed

    def ratio(self, step: int, lookback: int) -> float | None:
        """The agreed LR of ``step`` over the LR ``lookback`` steps before (None: unknown); records it."""
        if self.agreed is None:
            return None
        self.record(step, self.agreed)
        before = self.at(step - lookback)
        return self.agreed / before if before else None

    def record(self, step: int, lr: float) -> None:
        while self.steps and self.steps[-1][0] >= step:  # (a rollback went back: its undone steps go)
            self.steps.pop()
        if self.ramp_end is None and not self.steps and step > self.settle:
            self.ramp_end = 0  # (a history that begins mid-run -- a resume without the guard's state: not young)
        if self.ramp_end is None:  # (the first rise: the warmup; a later one -- a cut's end, a raised schedule -- not)
            if not self.steps or lr > self.peak * (1 + 1e-6):  # (against the peak, not the step before: a long
                self.last_rise, self.peak = step, max(self.peak, lr)  # linear or log warmup rises by < 0.1% a step)
            elif step - self.last_rise >= RAMP:
                self.ramp_end = self.last_rise
        self.steps.append((step, lr))

    def horizon(self) -> int:
        """The last step a climb may begin at and still be young: YOUNG x the LR's first rise (the newest rise while
        it has not held yet), or YOUNG x the detectors' settling time when that is longer (a run without warmup)."""
        rise = self.ramp_end if self.ramp_end is not None else self.last_rise
        return YOUNG * max(rise, self.settle)

    def young(self, onset: int) -> bool:
        """Whether a climb that began at ``onset`` began young: within :meth:`horizon`."""
        return onset <= self.horizon()

    def grown(self, step: int) -> bool:
        """Whether the run is past the point where a young climb can still be seen (the horizon, plus the settling
        time a verdict takes after its onset): the first step's checkpoint is no longer needed."""
        return self.ramp_end is not None and step > self.horizon() + self.settle

    def no_room(self, step: int, to_step: int = 1, now: float | None = None, then: float | None = None,
                restart: bool = True) -> str | None:
        """Why going back to ``to_step`` at ``step`` would harm the run, or None. Where the loop's count goes on through
        a rollback (Megatron-LM's iteration, HF Trainer's global_step) and ends at :attr:`last_step`, going back leaves
        the run ``last_step - step`` steps to train from ``to_step``'s weights: fewer than the ``step - to_step`` it
        throws away and the run ends further back than it was. A ``restart`` from the first step (``to_step`` 1:
        bench/natural's Megatron-LM peers, a restart at iteration 140 of 150 ended +1302% against plain's +983%), and
        the ordinary rollback for a creep (not ``restart``; trainguard.recovery.room.keeps_progress asks: the same
        case's rollback from 140 to 50 ended 4.168 against plain's 3.860) -- where the loss ``now`` is no higher than
        it was at ``to_step`` (``then``): the climb took none of the progress back, and an in-place cut keeps it. A
        rollback past a loss the climb made worse goes back to better weights: taken (None), as is one where either
        loss is unknown. Where the count rewinds with the
        weights (DeepSpeed's own loop) or the run's length is unknown, no step of the run is lost: None."""
        if self.last_step is None or to_step < 0:
            return None
        left, lost = self.last_step - step, step - max(to_step, 1)
        if left >= lost or not restart and (now is None or then is None or now > then):
            return None
        what = "restart from the first step" if restart else f"rollback to step {to_step}"
        return f"no {what}: it would throw away {lost} steps with {left} left (the run ends at step {self.last_step})"

    def at(self, step: int) -> float | None:
        """The LR of the newest recorded step <= ``step`` (the oldest recorded when none is)."""
        best = None
        for s, lr in self.steps:
            if s > step:
                break
            best = lr
        if best is None and self.steps:
            best = self.steps[0][1]
        return best

    def rising_into(self, onset: int) -> bool:
        """Whether a young run's LR was still rising into ``onset``: within its first rise (a long warmup climbs
        less than RISING in RAMP steps), or >= RISING x the LR RAMP steps before it (the oldest recorded when the run
        is younger): a warmup still under way when the trouble began."""
        if not self.young(onset):
            return False
        if 1 < onset <= (self.ramp_end if self.ramp_end is not None else self.last_rise):
            return True
        lr_onset, ref = self.at(onset), self.at(onset - RAMP)
        if not lr_onset or ref is None:
            return False
        return ref <= 0 or lr_onset >= RISING * ref

    def state_dict(self, last: int = 64) -> dict:
        """The newest ``last`` steps' LRs: saved with the guard, so that a resume at a raised schedule still sees the
        LR it jumped from (and a young run its LR's rise)."""
        return {"steps": [[s, lr] for s, lr in list(self.steps)[-last:]], "ramp_end": self.ramp_end,
                "last_rise": self.last_rise, "peak": self.peak}

    def load_state_dict(self, state: dict) -> None:
        self.steps.clear()
        for s, lr in state.get("steps", []):
            self.steps.append((int(s), float(lr)))
        self.last_rise, self.peak = int(state.get("last_rise") or 0), float(state.get("peak") or 0.0)
        end = state.get("ramp_end")
        self.ramp_end = int(end) if end is not None else None
        if "ramp_end" not in state and self.steps:  # (a guard state from before: its first rise unknown -- not young)
            self.ramp_end = 0

    def rewound(self, to_step: int) -> None:
        while self.steps and self.steps[-1][0] > to_step:
            self.steps.pop()

    def range_cut(self, bottom: int, now: int) -> tuple[float, str] | None:
        """The LR multiplier for a young run's bf16 start-over whose loss had climbed above where it began (from its
        ``bottom``) before the fp16 trouble and before the loss trend could speak: a tenth of the LR at the
        bottom -- the LR range test's rule, on the run's own ramp (a warmup of one step: its peak) --, and why; None
        where the LR fell since (a schedule's decay: not the LR the loss climbed at)."""
        lr_bottom, lr_now = self.at(bottom), self.at(now)
        if not self.steps or self.steps[0][0] > bottom or not lr_bottom or not lr_now or lr_bottom <= 0 \
                or lr_now < lr_bottom * (1 - 1e-6):  # (a bottom older than the LRs kept: not known)
            return None
        return TENTH * lr_bottom / lr_now, (
            f"its loss climbed above where it began (lowest at step {bottom}, at an LR of {lr_bottom:.3g}) before the fp16 "
            f"trouble: the LR was too high too -- a tenth of the LR where the loss stopped falling (the LR range test's "
            f"rule)")

    def cut(self, onset: int, now: int, configured: float) -> tuple[float, str, bool]:
        """The LR multiplier for a lowering decided at step ``now`` for a climb that began at ``onset``, why, and
        whether it comes with a restart from the first step's checkpoint (a young run)."""
        lr_now = self.at(now)
        if not lr_now or lr_now <= 0:
            return configured, "", False
        seen = list(self.steps)
        for i in range(3, len(seen)):
            s, lr = seen[i]
            prev = seen[i - 1][1]
            if onset - BEFORE <= s <= now and prev > 0 and lr >= JUMP * prev and prev < JUMP * seen[i - 3][1]:
                # (a jump from an LR that held: a warmup's first steps double the LR without jumping)
                if prev / lr_now > configured:  # (milder than the configured cut: that one, not the evidence's)
                    return configured, "", False
                return prev / lr_now, (
                    f"the LR jumped x{lr / prev:.3g} at step {s}: back to the LR before it ({prev:.3g})"), False
        lr_onset = self.at(onset) or lr_now
        if self.young(onset) and TENTH * lr_onset / lr_now <= configured:
            return TENTH * lr_onset / lr_now, (
                f"a young run (the climb began at step {onset}, within {YOUNG}x its LR's first rise or the detectors' "
                f"settling time: step {self.horizon()}): a tenth of the LR at the loss's best "
                f"({lr_onset:.3g}; the LR range test's rule), from the first step's checkpoint"), True
        return configured, "", False
