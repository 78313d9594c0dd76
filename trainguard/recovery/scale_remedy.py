"""The fp16 loss_scale ladder's remedy, carried out after its decision: the scale reset, its floor raised, or the run
gone on in bf16 (the framework's fallback)."""
from __future__ import annotations

from trainguard.errors import FallbackUnavailable
from trainguard.events import Action, Record, Remedy
from trainguard.recovery.policy import Decision


def carry_out(d, step: int, decision: Decision, rolled_back: bool) -> dict:
    """The loss_scale rung's remedy: reset the scale, also raise its floor, or continue in bf16 (``d``: the step
    driver, trainguard.step.driver.StepDriver)."""
    fw, guard = d.fw, d.guard
    guard.scaler_reset()
    if decision.remedy is Remedy.BF16_FALLBACK:
        if fw.checkpointer is not None:
            fw.checkpointer.wait_pending()
        try:
            detail = d.to_bf16(step)
            d.gating = False  # (rebuilt optimizers: decided at the step's start from here, every rank alike)
        except FallbackUnavailable as e:  # (where the framework itself stops -- fp16 at its floor: named)
            raise guard.abort(step, Decision(Action.ABORT, f"{decision.reason}: bf16 fallback unavailable: {e}",
                                             decision.verdicts)) from None
        except Exception as e:  # noqa: BLE001 - a conversion that failed part-way: no state to go on from
            raise guard.abort(step, Decision(Action.ABORT, f"{decision.reason}: the bf16 fallback failed part-way "
                                             f"({type(e).__name__}: {e}); stopped here, the checkpoint it rolled back to kept",
                                             decision.verdicts)) from e
        detail = {"from": "fp16", "to": "bf16", "at_step": fw.completed_steps(), **detail,
                  "after_rollback": rolled_back}
        d.policy.tried_also(step, Remedy.BF16_FALLBACK.value, detail)
        guard.emit(step, Record.PRECISION_FALLBACK, [], Remedy.BF16_FALLBACK.value, detail)
        if fw.checkpointer is not None:
            fw.checkpointer.after_precision_change()
        return detail
    scaler = fw.scaler()
    detail = {}
    if scaler is not None:
        if decision.remedy is Remedy.RAISE_FLOOR:
            detail.update(scaler.raise_floor(d.cfg.recovery.floor_factor))
        detail.update(scaler.reset())
    d.policy.tried_also(step, decision.remedy.value, {**detail, "after_rollback": rolled_back})
    guard.emit(step, Record.LOSS_SCALE_RESET, [], decision.remedy.value, detail)
    return detail
