"""Whether going back is worth what it costs the run: an ordinary rollback for a creep that the run has no room for.

Where the loop's count goes on through a rollback (Megatron-LM's iteration, HF Trainer's global_step), a rollback throws
away the steps since its checkpoint out of what the run has left; for a creep whose weights are sound and whose loss is
no worse than at the checkpoint, an LR lowered in place keeps the progress (trainguard.recovery.lrcut.LrHistory.no_room
says when). Asked by the driver (trainguard.step.driver) of the target it chose, on every rank together.
"""
from __future__ import annotations

from trainguard.events import Anomaly
from trainguard.ranks.isolation import all_true


def keeps_progress(cp, decision, step: int, at: int, weights: str | None) -> str | None:
    """Every rank together (one all-reduce, where it asks): why the ordinary rollback to the checkpoint of step ``at``
    chosen for ``decision`` at ``step`` is not taken -- a creep (a slow_rise, the LR lowered with it) whose going back
    would throw away more steps than the run has left, to weights whose loss at their save was no lower than now
    (trainguard.recovery.lrcut.LrHistory.no_room): the LR is lowered in place instead -- or None: taken. Never for
    damaged weights (``weights``: the replay's check), nor a step with a non-finite value or a burst among its verdicts.
    A rank that does not know a loss says "take it", and so every rank does."""
    if decision.anomaly != Anomaly.SLOW_RISE or not decision.lower_lr or cp.lr_history is None or at < 0 or \
            weights == "damaged" or any(v.anomaly in ("nonfinite", "instant_burst") for v in decision.verdicts):
        return None  # (the same on every rank: the decision, the weights check and the target are agreed)
    no = cp.lr_history.no_room(step, at, decision.loss, cp.saver.losses.get(at), restart=False)
    return f"{no}: the LR lowered in place" if all_true(bool(no)) else None
