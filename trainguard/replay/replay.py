"""Replays on an anomaly step: was it the data or the weights, and which sample was it?

Every non-finite or bursting step is skipped before its update, so the weights on that step are
the ones the last healthy step left. Replaying one micro-batch of that healthy step on them (no
gradients, RNG untouched) tells the two causes apart:

- its loss is still healthy: the *data* was bad. The weights took no damage, so there is nothing
  to roll back: skip the step (a burst of k bad batches costs k steps, and no rollback);
- its loss is non-finite or a spike now: the *weights* are damaged (an update applied earlier, or
  corruption in memory, did it). Skipping more batches cannot help: roll back at once.

The culprit rank also replays its own micro-batches one sample at a time and names the fewest
samples whose removal leaves a healthy batch: one corrupted sample is quarantined, not its whole
batch.

Framework-free: the adapter records its micro-batches here and gives a ``run(batch, row)`` that
returns the replayed loss as a float (``row`` None: the whole micro-batch). The verdicts are pure
functions of the losses; every rank applies them to the same gathered values.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence


@dataclass
class MicroBatch:
    """One micro-batch as the model saw it: ``inputs`` is the adapter's own (what it replays),
    ``ids`` the dataset indices of its rows in order (empty: unknown)."""

    inputs: Any
    ids: list[int] = field(default_factory=list)
    rows: int | None = None  # the batch size (the leading dimension), when the adapter knows it
    rng: Any = None          # the random-number state its training forward started from (detectors.peer_replay)
    value: Any = None        # that forward's (loss, output digest), device values, where the adapter measured them


class ReplayBook:
    """This step's micro-batches, and one micro-batch of the last healthy applied step."""

    def __init__(self) -> None:
        self.step: list[MicroBatch] = []
        self.healthy: MicroBatch | None = None

    def record(self, mb: MicroBatch) -> None:
        self.step.append(mb)

    def step_ended(self, healthy: bool) -> None:
        """The step is over: when it was applied and no anomaly was seen, its last micro-batch is
        the probe of the weights' health from now on."""
        if healthy and self.step:
            self.healthy = self.step[-1]
        self.step = []


def judge_loss(loss: float | None, robust_z: Callable[[float], float] | None, z: float) -> bool:
    """A loss is healthy when finite and (with a baseline) not more than ``z`` robust deviations
    above the median of the recent healthy losses (the loss-spike detector's own test)."""
    if loss is None or not math.isfinite(loss):
        return False
    return robust_z is None or robust_z(loss) <= z


def weights_verdict(replayed: Sequence[float | None], healthy: Callable[[float], bool]) -> str | None:
    """From every rank's replay of its last healthy micro-batch: "healthy", "damaged", or None when
    a rank had nothing to replay (the first steps, a replay the adapter cannot do). The mean over
    the ranks is judged like the step's own loss; one rank's non-finite replay is damage."""
    if not replayed or any(x is None for x in replayed):
        return None
    if any(not math.isfinite(x) for x in replayed):
        return "damaged"
    mean = sum(replayed) / len(replayed)
    return "healthy" if healthy(mean) else "damaged"


def culprit_rows(losses: Sequence[float | None], healthy: Callable[[float], bool],
                 max_fraction: float = 0.5) -> list[int] | None:
    """The fewest rows whose removal leaves a healthy batch: every row with a non-finite loss,
    then the highest losses one by one until the mean of the rest is healthy. None when a row
    could not be replayed, when no row is to blame (the rows replay healthy: the damage came
    after the forward), or when more than ``max_fraction`` of the rows would have to go (the
    whole batch is bad, not a few samples)."""
    if not losses or any(x is None for x in losses):
        return None
    bad = [i for i, x in enumerate(losses) if not math.isfinite(x)]
    rest = sorted((i for i, x in enumerate(losses) if math.isfinite(x)), key=lambda i: losses[i])
    limit = max(1, int(len(losses) * max_fraction))
    while True:
        mean = sum(losses[i] for i in rest) / len(rest) if rest else float("nan")
        if rest and healthy(mean):
            break
        if len(bad) >= limit or not rest:
            return None
        bad.append(rest.pop())
    if not bad:
        return None
    return sorted(bad)


MAX_ROWS = 256  # per-sample replays on one anomaly step, at most (a forward of one sample each)


def narrow(batches: Sequence[MicroBatch], run: Callable[[MicroBatch, int | None], float | None],
           healthy: Callable[[float], bool], max_rows: int = MAX_ROWS) -> dict | None:
    """Name the culprit samples of this step's micro-batches: with several, each is replayed whole
    first and only those that do not replay healthy are searched; then every row of those alone.
    Returns ``{"ids": [...], "rows": n, "losses": {id: loss}}`` (the culprits' replayed losses), or
    None when no narrowing was possible (rows or ids unknown, more than ``max_rows`` rows to search,
    or :func:`culprit_rows` found none)."""
    for mb in batches:
        if mb.rows is None or not mb.ids or len(mb.ids) != mb.rows:
            return None
    if len(batches) > 1:
        whole = [run(mb, None) for mb in batches]
        batches = [mb for mb, loss in zip(batches, whole) if loss is None or not healthy(loss)]
    pool: list[tuple[int, MicroBatch, int]] = [(sid, mb, r) for mb in batches for r, sid in enumerate(mb.ids)]
    if len(pool) < 2 or len(pool) > max_rows:
        return None
    losses = [run(mb, r) for _, mb, r in pool]
    rows = culprit_rows(losses, healthy)
    if rows is None:
        return None
    return {"ids": [pool[i][0] for i in rows], "rows": len(pool),
            "losses": {str(pool[i][0]): loggable(losses[i]) for i in rows}}


def loggable(x: float | None):
    """A replayed loss for the log: a non-finite one as its text ("nan", "inf"), which the JSONL writer
    would otherwise turn into null -- the same as no replay at all."""
    return x if x is None or math.isfinite(x) else str(x)
