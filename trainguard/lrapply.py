"""How trainguard's LR multiplier reaches the framework's optimizer: for one update (the groups scaled, then put back),
or through a closed-form scheduler that applies it itself (so the framework's log, state and optimizer all hold the
LR the update uses)."""
from __future__ import annotations

import contextlib
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


def schedule_scaled(scheduler, multiplier: Callable[[], float]) -> None:
    """A closed-form scheduler (its ``get_lr(group)`` reads its own step count, as Megatron-LM's does) that applies
    trainguard's multiplier itself: every LR it sets -- the optimizer's, the framework's log, its state -- is the LR
    the next update uses (the driver then leaves the groups alone: ``lr_scaled_by_scheduler``)."""
    scheduled = scheduler.get_lr
    scheduler.get_lr = lambda group: scheduled(group) * multiplier()


def first_lr(groups: list[dict]) -> float | None:
    try:
        return float(groups[0]["lr"]) if groups else None
    except (KeyError, TypeError, ValueError):
        return None
