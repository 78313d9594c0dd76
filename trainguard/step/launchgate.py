"""DECIDE at the update's launch: the agreed row read on the host as late as the step allows (issue 52).

The step's collective (AGREE) is launched when the framework's step begins, and read when the framework launches the
update -- the call of the one torch optimizer its step ends in. In between the framework queues its own pre-step work
(its global norm, its clipping, its copies to the master weights, its own host synchronisations): on a GPU the
host's read then waits for the backward and the collective alone, while the GPU still has that work to run; before,
the read at the step's start emptied the GPU's queue and the GPU waited while the host decided and the framework's
Python caught up. The decision itself is the same, on every rank, from the same row, and still taken before anything
is applied: a step not to apply is refused at the launch, and the framework's own skip bookkeeping told so by the
adapter (``decline``: DeepSpeed's engine counts a step whose optimizer says ``overflow`` as skipped and leaves the
scheduler alone). A framework that skips the update by itself (a non-finite norm) never reaches the launch: the
decision is taken after its step returned, when nothing was applied.

What is not gated here (an adapter says): anything that changes state between its step's start and the launch on a
decision's behalf -- fp16's dynamic loss scaler (updated before the launch), adaptive clipping (its limit is set before
the framework clips), ZeRO-3 and offloaded optimizers (their launches are per sub-group, with state moved around them).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

from trainguard.events import Action

REFUSED = (Action.SKIP_STEP, Action.ROLLBACK)  # (an abort: ``decide()`` raises it -- refused, raised once the step ended)


class LaunchGate:
    """``inner``: the torch optimizer whose ``step()`` launches the update; ``decline()``: tells the framework this
    step's update was refused (its skip path's bookkeeping), ``restore()``: undoes that once its step returned."""

    def __init__(self, inner, decline: Callable[[], None], restore: Callable[[], None]):
        self.inner, self.decline, self.restore = inner, decline, restore

    @classmethod
    def at(cls, outer, wrappers: Sequence[str], flag: str) -> "LaunchGate | None":
        """The gate of a framework's optimizer ``outer`` (one of ``wrappers``, by class name, that keeps an attribute
        ``flag`` of its own, around a torch optimizer reached through ``.optimizer``; or that torch optimizer itself)
        whose refused step is told by setting ``flag`` (put back after); None where the update is not one torch
        optimizer's launch, or where that launch writes state before it reads the gradients (Muon's momentum)."""
        import torch

        inner = outer
        while not isinstance(inner, torch.optim.Optimizer) and hasattr(inner, "optimizer"):
            inner = inner.optimizer
        if not isinstance(inner, torch.optim.Optimizer) or "Muon" in type(inner).__name__ or \
                not (outer is inner or (type(outer).__name__ in wrappers and flag in vars(outer))):
            return None  # (a wrapper without the flag does not skip by it: DeepSpeed 0.16-0.18's BF16_Optimizer asserts)
        had, old = flag in vars(outer), vars(outer).get(flag)
        return cls(inner, lambda: setattr(outer, flag, True),
                   lambda: setattr(outer, flag, old) if had else delattr(outer, flag))

    def run(self, decide: Callable[[], Any], base_step: Callable[[], Any]) -> tuple[Any, Any, bool]:
        """``base_step()``, with ``decide()`` taken once, right before ``inner.step()`` runs (a framework that launches
        per parameter group calls it again: the same decision). Returns (the step's result, the decision, whether
        the launch was reached); not reached, the decision is taken after the step returned."""
        inner = self.inner
        shadowed = vars(inner).get("step")  # (an instance's own step, if any: put back after)
        launch = inner.step
        decision, declined, raised = None, False, None

        def step(*args, **kwargs):
            nonlocal decision, declined, raised
            if decision is None and raised is None:
                try:
                    decision = decide()
                except BaseException as e:  # noqa: BLE001 - (an abort: the framework's step ends as a skip, then it)
                    raised = e
            if raised is not None or decision.action in REFUSED:
                if not declined:
                    declined = True
                    self.decline()
                return None
            return launch(*args, **kwargs)

        functools.update_wrapper(step, launch, assigned=(), updated=("__dict__",))  # (an LR scheduler's mark on it)
        inner.step = step
        try:
            result = base_step()
        finally:
            if shadowed is None:
                del inner.step
            else:
                inner.step = shadowed
            if declined:
                self.restore()
        if raised is not None:
            raise raised
        reached = decision is not None
        return result, (decision if reached else decide()), reached
