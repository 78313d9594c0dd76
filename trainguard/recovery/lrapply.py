"""How trainguard's LR multiplier reaches the framework's optimizer: for one update (the groups scaled, then put back),
or through a closed-form scheduler that applies it itself (so the framework's log, state and optimizer all hold the
LR the update uses)."""
from __future__ import annotations

import contextlib
import weakref
from typing import Callable, Iterator


@contextlib.contextmanager
def scaled_lr(groups: list[dict], mult: float) -> Iterator[float | None]:
    """Every group's LR x ``mult`` for one step (yields the first group's); afterwards the
    scheduled LR is put back, unless the scheduler set a new one meanwhile."""
    saved = [g["lr"] for g in groups]
    for g in groups:
        g["lr"] = g["lr"] * mult
    boosted = [g["lr"] for g in groups]
    try:
        yield boosted[0] if boosted else None
    finally:
        for g, old, new in zip(groups, saved, boosted):
            if g["lr"] == new:
                g["lr"] = old


# the schedulers whose LR is a function of their step count alone (never of the LR the optimizer holds): Megatron-LM's,
# torch's LambdaLR (every HF Trainer schedule), DeepSpeed's own -- a multiplier applied inside them is never compounded
CLOSED_FORM = ("OptimizerParamScheduler", "LambdaLR", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle")


_MULTIPLIER: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # scheduler -> trainguard's multiplier


def _one() -> float:
    return 1.0


def closed_form(scheduler) -> bool:
    return scheduler is not None and type(scheduler).__name__ in CLOSED_FORM and callable(getattr(scheduler, "get_lr",
                                                                                                  None))


def schedule_scaled(scheduler, multiplier: Callable[[], float]) -> Callable[[], None]:
    """A closed-form scheduler (:data:`CLOSED_FORM`) that applies trainguard's multiplier itself: every LR it sets --
    the optimizer's, the framework's log (Megatron-LM's line, HF's ``learning_rate``, DeepSpeed's ``get_lr()``), its
    ``get_last_lr()`` -- is the LR the next update uses (the driver then leaves the groups alone:
    ``lr_scaled_by_scheduler``). Its class is swapped for a subclass of the same name overriding ``get_lr`` (an
    instance attribute would travel in a torch scheduler's ``state_dict``). Returns the refresh: the optimizer's LRs
    set from the scheduler now, its step count unmoved (a lowering takes effect at once)."""
    import warnings

    _MULTIPLIER[scheduler] = multiplier  # (looked up at each get_lr: a later session's replaces an earlier one's)
    cls = type(scheduler)
    if getattr(cls, "_trainguard_refresh", None) is not None:  # (scaled already: an engine rebuilt around it)
        return cls._trainguard_refresh
    if cls.__name__ == "OptimizerParamScheduler":  # (Megatron's: get_lr(param_group), step(increment))
        def get_lr(self, group):
            return cls.get_lr(self, group) * _MULTIPLIER.get(self, _one)()

        def refresh_one() -> None:
            scheduler.step(increment=0)
        scheduler.__class__ = type(cls.__name__, (cls,), {"get_lr": get_lr, "__module__": cls.__module__,
                                                          "_trainguard_refresh": staticmethod(refresh_one)})
        return refresh_one

    def get_lr_all(self):
        mult = _MULTIPLIER.get(self, _one)()
        return [lr * mult for lr in cls.get_lr(self)]

    def refresh() -> None:
        with warnings.catch_warnings():  # (torch warns of get_lr() called outside step(): here on purpose)
            warnings.simplefilter("ignore")
            lrs = scheduler.get_lr()
        for group, lr in zip(scheduler.optimizer.param_groups, lrs):
            group["lr"] = lr
        scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
    scheduler.__class__ = type(cls.__name__, (cls,), {"get_lr": get_lr_all, "__module__": cls.__module__,
                                                      "_trainguard_refresh": staticmethod(refresh)})
    return refresh


def first_lr(groups: list[dict]) -> float | None:
    try:
        return float(groups[0]["lr"]) if groups else None
    except (KeyError, TypeError, ValueError):
        return None


def goes_on(owner, counter: str, scheduler, step: int) -> dict:
    """A loop that cannot rewind (HF's Trainer, an Accelerate loop: its step counter, its log and its checkpoint-N
    names go on past a rollback) goes on at ``step``: the framework's own counter (``owner.<counter>``, which came
    back with the checkpoint) set to it, and its torch-style LR scheduler stepped forward to it -- the LR schedule of
    a run without the fault, as Megatron-LM's loop has it. What the rollback record says under ``loop``."""
    loaded = int(getattr(owner, counter))
    if loaded >= step:
        return {}
    for _ in range(step - loaded) if scheduler is not None else ():
        scheduler.step()
    setattr(owner, counter, step)
    return {"iteration": step, "weights_from_step": loaded, "kept": [counter, "lr_schedule"],
            "not_replayed_iterations": [loaded + 1, step],
            "why": "the loop keeps its own step counter: the framework's counter and LR schedule go on with it"}
