"""What the policy (trainguard.recovery.policy) decides over, and what it returns: a verdict's anomaly class -- the ladder
it climbs (None: it alerts only), the onset a rollback for it must predate, whether its non-finite values came
from the forward, the classes a replay decides, what a young run is -- and the :class:`Decision`, which the step driver carries out
(trainguard.step.driver) and the records name."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

from trainguard.events import Action, Anomaly, Remedy
from trainguard.verdicts import Verdict

DATA_OR_WEIGHTS = (Anomaly.NONFINITE, Anomaly.INSTANT_BURST)  # the classes a replay of a healthy micro-batch decides
# A young run (its restart from the first step's checkpoint: trainguard.recovery.lrcut, trainguard.checkpoint.first):
YOUNG = 2        # a climb that begins within this many times the LR's first rise (or the detectors' settling time):
                 # its LR settings are what fails there
SETTLE = 54      # the steps the loss trend takes to speak on a run that climbs at once: its history, the window its
                 # level needs, its patience (min_history + 4 x smooth + patience; the guard passes the configured ones)


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str
    verdicts: tuple[Verdict, ...] = field(default_factory=tuple)
    lower_lr: bool = False          # ROLLBACK: also scale the LR, by lr_scale
    lr_scale: float | None = None   # ROLLBACK with lower_lr: the multiplier (None: recovery.lr_factor)
    restart: bool = False           # ROLLBACK: to the first step's checkpoint, with lr_scale (trainguard.recovery.lrcut);
                                    # where there is none, an ordinary rollback with recovery.lr_factor
    lasting: bool = False           # ROLLBACK with lower_lr: the cut outlives the cooldown (the schedule's own LR
                                    # is what failed: a young run's, a jump's -- trainguard.recovery.lrcut)
    onset_step: int | None = None   # ROLLBACK: the checkpoint must predate this step
    anomaly: Anomaly | None = None  # the class that drove the decision
    remedy: Remedy | None = None    # loss_scale ROLLBACK: what is done to the scaler after it
    onset_skipped: bool = False     # ROLLBACK: the onset step itself was skipped, so a checkpoint saved
                                    # at it holds the state from before the anomaly and may be chosen
    target: str | None = None       # ROLLBACK: "latest_valid" / "stable" (None: recovery.rollback_to)
    loss: float | None = None       # ROLLBACK: the loss when decided (the step's, or the window's median when higher):
                                    # what a target must beat where the run has no room (trainguard.recovery.lrcut)

    def as_ordinary(self, lr_factor: float, why: str) -> "Decision":
        """A restart that cannot be had (no first step's checkpoint, or it did not load): an ordinary rollback, with the
        ordinary cut (``lr_factor``) for the cooldown where a climb lowered the LR -- a bf16 start-over's cut (sized by
        its LR range test: trainguard.step.judgement) goes with the restart it was sized for."""
        lower = self.lower_lr and self.remedy is not Remedy.BF16_FALLBACK
        return replace(self, restart=False, lower_lr=lower, lr_scale=lr_factor if lower else None, lasting=False,
                       reason=self.reason + why + (f", LR x{lr_factor:.3g} instead, for the cooldown" if lower else ""))


def forced(action: str, step: int, lr_factor: float, fp16: bool = True) -> Decision:
    """The decision a ``force_action`` fault puts in place of a healthy step's (trainguard.faults): what the policy
    could decide, forced where no detector would -- so that every recovery path is tried in the states a run really
    reaches (its first step, fp16's scale search, the step after a restart). ``fp16``: the run has an fp16 dynamic
    loss scale -- without one (bf16 from the start, or after a fallback) the policy never reaches a bf16 fallback
    (the loss-scale ladder is fp16's), and a forced one is the skip it would be."""
    why = f"forced by a force_action fault: {action}"
    if action == "bf16_fallback" and not fp16:
        return Decision(Action.SKIP_STEP, why + " (no fp16 loss scale here: the policy never reaches it, skipped)")
    if action == "skip":
        return Decision(Action.SKIP_STEP, why)
    if action == "bf16_fallback":
        return Decision(Action.ROLLBACK, why, onset_step=step, anomaly=Anomaly.LOSS_SCALE,
                        remedy=Remedy.BF16_FALLBACK, onset_skipped=True)
    return Decision(Action.ROLLBACK, why, onset_step=step, anomaly=Anomaly.INSTANT_BURST, onset_skipped=True,
                    lower_lr=action in ("lr_cut", "restart"), lr_scale=lr_factor if action in ("lr_cut", "restart")
                    else None, restart=action == "restart",
                    target={"rollback_newest": "latest_valid", "rollback_stable": "stable"}.get(action))


def onset_of(verdicts: Sequence[Verdict], cls: Anomaly, step: int) -> int:
    """Where a rollback for ``cls`` must go back to before: the earliest onset its verdicts give, else ``step``."""
    given = [v.detail["onset_step"] for v in verdicts if anomaly_class(v) == cls and v.detail.get("onset_step")]
    return min(given) if given else step


def from_forward(verdicts: Sequence[Verdict]) -> bool:
    """Whether a non-finite verdict came from the forward (a loss or an activation), not the gradients alone."""
    return any(v.anomaly == "nonfinite" and any(d.get("origin") in ("loss", "activation")
                                               for d in (v.detail.get("per_rank") or {}).values()
                                               if isinstance(d, dict)) for v in verdicts)


def anomaly_class(v: Verdict) -> Anomaly | None:
    """The ladder class of a verdict (None: it alerts only)."""
    try:
        return Anomaly(v.anomaly)
    except ValueError:
        return None
