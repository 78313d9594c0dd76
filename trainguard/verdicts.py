"""What a detector sees (one row per rank, identical on every rank) and what it returns."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence


@dataclass(frozen=True)
class RankObservation:
    """One rank's local values for one optimizer step, as gathered by the AGREE collective.

    ``loss`` is the mean of the losses this rank passed to ``backward`` over its micro-batches;
    ``grad_norm`` is the 2-norm of this rank's *local* gradients (before the data-parallel
    reduction), unscaled by the fp16 loss scale; None when gradients were not checked.
    """

    rank: int
    loss: float
    micro_batches: int
    loss_nonfinite: int
    grad_norm: float | None
    faults_fired: int = 0
    samples_rejected: int = 0
    prev_grad_norm: float = float("nan")   # the framework's global norm of the previous step (deferred)
    clock: float = float("nan")            # this rank's wall clock at AGREE (its heartbeat, for the metrics)
    prev_applied_sq: float = float("nan")  # its squared norm of the gradients the previous step applied
    compute_s: float = float("nan")        # its own data + forward time of this step (trainguard.step.steptime)
    lr: float = float("nan")               # its LR of the coming update (rank 0's decides: the same on every rank)
    extra: dict = field(default_factory=dict, compare=False, hash=False)  # registered detectors' columns

    @property
    def has_loss(self) -> bool:
        """False on a rank that computes no loss (a pipeline stage before the last)."""
        return self.micro_batches > 0

    @property
    def loss_finite(self) -> bool:
        return not self.has_loss or (self.loss_nonfinite == 0 and math.isfinite(self.loss))

    @property
    def grad_finite(self) -> bool:
        return self.grad_norm is None or math.isfinite(self.grad_norm)


@dataclass(frozen=True)
class Verdict:
    """A detector's finding: which anomaly, on which ranks, and the numbers behind it."""

    detector: str
    anomaly: str
    ranks: tuple[int, ...]
    detail: dict = field(default_factory=dict)


def shared_or(anomaly: str, ranks) -> tuple[int, ...]:
    """A verdict's ranks: none for a ``slow_rise`` -- a climb of the run's loss or gradient norm is the LR's, a trend
    every rank shares, not the doing of the rank that happened to hold the highest value -- else ``ranks``."""
    return () if anomaly == "slow_rise" else tuple(ranks)


@dataclass
class PeerContext:
    """What the guard hands the detector at DECIDE (the same shape on every rank)."""

    rank: int
    coords: Sequence                 # trainguard.ranks.isolation.RankCoords of every rank
    device: Any                      # the collective's (a torch.device)
    group: Any                       # the AGREE group (None: world)
    batch: Any                       # this rank's last training micro-batch of the step (trainguard.replay.replay.MicroBatch)
    replay: Callable[[Any, int], tuple]  # ((inputs, rng), seed) -> (loss or None, digest or None), forward-only
    healthy: Callable[[float], bool]     # the loss-spike detector's judgement of a loss
    unexplained: Sequence[int] = field(default_factory=tuple)  # culprits of a spike neither data nor weights explain
    step_loss: Mapping[int, float] = field(default_factory=dict)  # {rank: its training loss of the step}: every
    # rank's where the step's rows are (trainguard.step.agreement), else the rank with the highest


@dataclass(frozen=True)
class ScalerState:
    """An fp16 dynamic loss scaler as the loss-scale watch sees it at the start of a step."""

    scale: float
    min_scale: float
    hysteresis: int | None = None   # overflows still absorbed before the next halving (None: no hysteresis)
