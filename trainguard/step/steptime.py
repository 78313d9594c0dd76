"""Each rank's own time for a step, without a host synchronisation: from the end of its previous
step to the end of its last forward of this one (data loading and forward: no gradient collective
has run yet, so a fast rank has not started waiting for a slow one). It rides in the AGREE table
(``compute_s``), where the straggler detector compares the ranks. What it cannot separate: with
gradient accumulation the earlier micro-batches' backward passes (and any collective they run) are
inside the span; under tensor parallelism the TP all-reduces inside the forward make a TP group's
ranks wait for each other (a slow rank is then seen against the other data-parallel replicas).

On CUDA the forward returns before the device has run it: the span is taken between two CUDA events
and read one step late, when the AGREE of the next step has synchronised anyway (``query()`` is
true by then; never waited on).
"""
from __future__ import annotations

import time

import torch


class StepTimer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda" and torch.cuda.is_available()
        self._start = None       # host: perf_counter; CUDA: an event
        self._mark = None
        self._pending = None     # CUDA: (start, mark) of the previous step, read at this AGREE

    def start(self) -> None:
        """At the end of a step (and at BEGIN)."""
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()
        self._mark = None

    def mark(self) -> None:
        """At the end of a forward (the last one of the step counts)."""
        if self._start is None:
            return
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._mark = ev
        else:
            self._mark = time.perf_counter()

    def take(self) -> float:
        """At AGREE: seconds (NaN when unknown: no forward marked, or the first CUDA step)."""
        start, mark = self._start, self._mark
        if not self.cuda:
            return (mark - start) if start is not None and mark is not None else float("nan")
        done, self._pending = self._pending, (start, mark) if start is not None and mark is not None else None
        if done is not None and done[1].query():
            return done[0].elapsed_time(done[1]) / 1000.0
        return float("nan")
