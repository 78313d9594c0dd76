"""The step at a glance: what the check of a clear step reads (trainguard.step.launchgate), from the gathered table's
rows as they came off the device -- one pass over plain floats, before anything else is made of them.

A healthy step's decision waits for the update's launch, and the host time between the backward's end and that launch
is the guard's cost on a GPU (issue 52). The clear check reads six figures of the step's summary; making every rank's
:class:`trainguard.verdicts.RankObservation` and the whole :class:`trainguard.ranks.reduced.Summary` first took more
host time than the rest of the read. So the check reads a :class:`Glance`, and the observations and the summary are
made after the launch (trainguard.step.agreement's table view), when the step's DECIDE runs. The figures are the
summary's own, by the same formulas in the same order (tests/unit/test_glance.py holds them equal, NaN and Inf
included); anything else asked of a glance -- a detector of yours whose ``clear`` reads another field -- is the
summary's, made then.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from trainguard.ranks.isolation import F

_MICRO, _LOSS, _LOSS_BAD = F["micro_batches"], F["loss_sum"], F["loss_nonfinite"]
_CHECKED, _GRAD_SQ = F["grad_checked"], F["grad_sq"]
_FAULTS, _SAMPLES = F["faults_fired"], F["samples_rejected"]


class Glance:
    """``bad``, ``loss_bad``, ``faults_fired``, ``samples_rejected``, ``grad_proxy``, ``loss_mean`` and ``needs_rows``
    as :class:`trainguard.ranks.reduced.Summary` defines them; any other attribute from ``full()``, the summary."""

    __slots__ = ("bad", "loss_bad", "faults_fired", "samples_rejected", "grad_proxy", "loss_mean", "_full")

    def __init__(self, rows: Sequence[Sequence[float]], loss_scale: float, grad_divisor: float,
                 full: Callable[[], Any]):
        self._full = full
        losses, norms = [], []
        loss_bad = bad = faults = samples = 0
        for row in rows:
            micro = int(row[_MICRO])
            finite = True
            if micro > 0:  # (RankObservation.has_loss)
                loss = row[_LOSS] / micro
                losses.append(loss)
                finite = int(row[_LOSS_BAD]) == 0 and math.isfinite(loss)
            norm = None
            if row[_CHECKED] > 0:
                sq = row[_GRAD_SQ]
                norm = math.sqrt(sq) / loss_scale * grad_divisor if math.isfinite(sq) else sq
            norms.append(norm)
            loss_bad += not finite
            bad += not (finite and (norm is None or math.isfinite(norm)))
            faults += int(row[_FAULTS])
            samples += int(row[_SAMPLES])
        self.bad, self.loss_bad, self.faults_fired, self.samples_rejected = bad, loss_bad, faults, samples
        self.loss_mean = sum(losses) / len(losses) if losses and not loss_bad else math.nan
        self.grad_proxy = math.sqrt(sum(n * n for n in norms) / len(norms)) \
            if norms and all(n is not None for n in norms) else None

    @property
    def needs_rows(self) -> bool:
        return bool(self.bad or self.faults_fired or self.samples_rejected)

    def __getattr__(self, name: str):  # (only for what the slots do not hold)
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._full(), name)
