"""What a healthy step needs from every rank, in a fixed size whatever the world's: sums and extremes.

Each rank turns its own AGREE row (trainguard.ranks.isolation.FIELDS) into two short vectors on its device --
:func:`contribution` -- and two all-reduces (SUM, MAX) combine them: 15 float64 sums and 6 int64 keys,
168 bytes per rank at any world size. What they carry: how many ranks had a non-finite loss or gradient,
the mean loss over the ranks that have one, the gradient-norm proxy (the root mean square of the local
norms), rank 0's LR and framework norm, the summed applied norm, compute time and clock sums, and the
extremes a detector compares against *with the rank that holds each*.

An extreme travels as one int64 key: the float64's bits mapped so that integer order is float order
(negative values' magnitude bits flipped), the lowest ``bits`` replaced by ``2**bits - 1 - rank``. The
MAX of the keys is then the largest value and, among values equal in the remaining 52 - ``bits`` bits of
mantissa (a relative 2**-36 at 65,536 ranks), the lowest rank -- the same rank ``attribution.argmax``
names. A NaN is never an extreme (its key is the smallest int64).

Every rank reads the same reduced bytes (an all-reduce hands every rank the same result, which is what keeps
data-parallel replicas bit-identical), so every rank reaches the same verdict.

:meth:`Summary.of_rows` computes the same fields from a gathered table, with the formulas the detectors
used on it before (Python sums in rank order, ``argmax``): the table path (trainguard.step.agreement) stays
bit-for-bit what it was.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Sequence

import torch

from trainguard.ranks.attribution import argmax
from trainguard.ranks.isolation import F
from trainguard.verdicts import RankObservation

SUMS = ("ranks", "loss_ranks", "loss_bad", "loss_mean_sum", "bad", "checked", "grad_bad", "norm_sq_sum", "faults_fired",
        "samples_rejected", "lr", "prev_grad_norm", "prev_applied_sq", "compute_sum", "compute_ranks")
EXTREMES = ("loss_max", "grad_norm_max", "compute_max", "compute_min", "clock_max", "clock_min")
S = {n: i for i, n in enumerate(SUMS)}
NEGATED = {"compute_min", "clock_min"}  # (a minimum travels as the maximum of the negated value)
SENTINEL = -(2 ** 63)                   # the key of "no value" (NaN)
_FLIP = 0x7FFF_FFFF_FFFF_FFFF
BYTES = 8 * (len(SUMS) + len(EXTREMES))  # per rank, per step


def rank_bits(world: int) -> int:
    return max(1, (max(world, 1) - 1).bit_length())


def contribution(rows: torch.Tensor, ranks: torch.Tensor, loss_scale: float, grad_divisor: float,
                 bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` ``[n, >= len(FIELDS)]`` float64 (one rank's row: ``n = 1``), ``ranks`` ``[n]`` int64 -> their
    sums ``[n, len(SUMS)]`` float64 and keys ``[n, len(EXTREMES)]`` int64, computed on the rows' device (no host
    sync). Summing and maxing over ``n`` gives the reduced vectors (what a simulation of many ranks does)."""
    has_loss, loss, loss_ok = losses(rows)
    loss_bad = has_loss & ~loss_ok
    checked = rows[:, F["grad_checked"]] > 0
    sq = rows[:, F["grad_sq"]]
    norm_ok = checked & torch.isfinite(sq)
    norm = torch.sqrt(torch.where(norm_ok, sq, torch.zeros_like(sq))) / loss_scale * grad_divisor
    compute = rows[:, F["compute_s"]]
    compute_ok = torch.isfinite(compute) & (compute >= 0)
    first = ranks == 0
    zero = torch.zeros_like(loss)
    good_loss = has_loss & loss_ok
    sums = torch.stack([
        torch.ones_like(loss), has_loss.double(), loss_bad.double(), torch.where(good_loss, loss, zero),
        (loss_bad | (checked & ~norm_ok)).double(), checked.double(), (checked & ~norm_ok).double(),
        torch.where(norm_ok, norm * norm, zero),
        rows[:, F["faults_fired"]], rows[:, F["samples_rejected"]],
        torch.where(first, rows[:, F["lr"]], zero), torch.where(first, rows[:, F["prev_grad_norm"]], zero),
        rows[:, F["prev_applied_sq"]], torch.where(compute_ok, compute, zero), compute_ok.double()], dim=1)
    nan = torch.full_like(loss, math.nan)
    clock = rows[:, F["clock"]]
    values = torch.stack([torch.where(good_loss, loss, nan), torch.where(norm_ok, norm, nan),
                          torch.where(compute_ok, compute, nan), torch.where(compute_ok, -compute, nan),
                          clock, -clock], dim=1)
    return sums, keys(values, ranks, bits)


def losses(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's (has a loss, its mean loss over its micro-batches, that loss is finite and none was flagged)."""
    micro = rows[:, F["micro_batches"]]
    has_loss = micro > 0
    loss = rows[:, F["loss_sum"]] / torch.where(has_loss, micro, torch.ones_like(micro))
    return has_loss, loss, torch.isfinite(loss) & (rows[:, F["loss_nonfinite"]] == 0)


def keys(values: torch.Tensor, ranks: torch.Tensor, bits: int) -> torch.Tensor:
    """Order-preserving int64 keys of float64 ``values`` ``[n, k]`` with each row's rank in the low ``bits``."""
    b = values.contiguous().view(torch.int64)
    k = torch.where(b < 0, b ^ _FLIP, b)
    mask = (1 << bits) - 1
    k = (k & ~mask) | (mask - ranks.to(torch.int64)).unsqueeze(1)
    return torch.where(torch.isnan(values), torch.full_like(k, SENTINEL), k)


def decode(key: int, bits: int) -> tuple[float, int | None]:
    """A reduced key -> (its value, truncated to the key's mantissa; the rank that holds it). (NaN, None): none."""
    if key == SENTINEL:
        return math.nan, None
    mask = (1 << bits) - 1
    rank = mask - (key & mask)
    # (the encoding cleared the low bits of the ordered key; for a negative value that set them in its bits: back)
    v = (key | mask) ^ _FLIP if key < 0 else key & ~mask
    return struct.unpack("<d", struct.pack("<q", v))[0], rank


def as_floats(ints: Sequence[int]) -> list[float]:
    """int64 bit patterns (a float64 tensor read through its int64 view) -> the floats."""
    return list(struct.unpack(f"<{len(ints)}d", struct.pack(f"<{len(ints)}q", *ints)))


@dataclass(frozen=True)
class Extreme:
    value: float
    rank: int | None   # None: no rank had a value

    def as_list(self) -> list:
        return [self.value if math.isfinite(self.value) else None, self.rank]


@dataclass(frozen=True)
class Summary:
    """Every rank's step in fixed size (module docstring). ``loss_mean`` is NaN when a rank's loss was not
    finite (or no rank has one); ``grad_proxy`` (the root mean square of the local gradient norms) None unless
    every rank checked its gradients, NaN when one was not finite; ``lr`` and ``prev_grad_norm`` are rank 0's."""

    world: int
    loss_ranks: int
    loss_bad: int
    loss_mean: float
    bad: int
    checked: int
    grad_proxy: float | None
    faults_fired: int
    samples_rejected: int
    lr: float
    prev_grad_norm: float
    prev_applied_sq: float
    compute_mean: float | None
    loss_max: Extreme
    grad_norm_max: Extreme
    compute_max: Extreme
    compute_min: Extreme
    clock_max: Extreme
    clock_min: Extreme

    @property
    def finite_loss(self) -> float | None:
        """The step's loss for checkpoint health: the mean over the ranks that have one (the last pipeline stage holds
        it under megatron), None when any of them is not finite."""
        return self.loss_mean if math.isfinite(self.loss_mean) else None

    @property
    def loss_rank(self) -> int:
        """The rank with the highest finite loss (0 when none): what a loss verdict names."""
        return self.loss_max.rank or 0

    @property
    def grad_rank(self) -> int:
        return self.grad_norm_max.rank or 0

    @property
    def needs_rows(self) -> bool:
        """Something only the ranks' own rows can name: a non-finite value, a fault fired, samples set aside."""
        return bool(self.bad or self.faults_fired or self.samples_rejected)

    @classmethod
    def reduced(cls, sums: Sequence[float], key_ints: Sequence[int], bits: int) -> "Summary":
        s = dict(zip(SUMS, sums))
        world = int(s["ranks"])
        ex = {}
        for name, k in zip(EXTREMES, key_ints):
            v, r = decode(int(k), bits)
            ex[name] = Extreme(-v if name in NEGATED else v, r)
        loss_ranks, loss_bad = int(s["loss_ranks"]), int(s["loss_bad"])
        checked, bad = int(s["checked"]), int(s["bad"])
        compute_ranks = int(s["compute_ranks"])
        return cls(world=world, loss_ranks=loss_ranks, loss_bad=loss_bad,
                   loss_mean=s["loss_mean_sum"] / loss_ranks if loss_ranks and not loss_bad else math.nan,
                   bad=bad, checked=checked,
                   grad_proxy=None if checked < world else math.nan if s["grad_bad"] else
                   math.sqrt(s["norm_sq_sum"] / world),
                   faults_fired=int(s["faults_fired"]), samples_rejected=int(s["samples_rejected"]), lr=s["lr"],
                   prev_grad_norm=s["prev_grad_norm"], prev_applied_sq=s["prev_applied_sq"],
                   compute_mean=s["compute_sum"] / world if compute_ranks == world else None, **ex)

    @classmethod
    def of_rows(cls, obs: Sequence[RankObservation]) -> "Summary":
        """The same fields from every rank's row (the table path), with the detectors' former formulas."""
        with_loss = [o.loss for o in obs if o.has_loss]
        loss_bad = sum(1 for o in obs if not o.loss_finite)
        bad = sum(1 for o in obs if not (o.loss_finite and o.grad_finite))
        norms = [o.grad_norm for o in obs]
        proxy = math.sqrt(sum(n * n for n in norms) / len(norms)) if obs and all(n is not None for n in norms) else None
        times = [o.compute_s for o in obs]
        timed = all(isinstance(t, float) and math.isfinite(t) and t >= 0 for t in times)
        losses = [o.loss if o.has_loss else None for o in obs]

        def extreme(values, sign=1.0) -> Extreme:
            finite = [v for v in values if v is not None and math.isfinite(v)]
            if not finite:
                return Extreme(math.nan, None)
            r = argmax([None if v is None else sign * v for v in values])
            return Extreme(values[r], r)

        first = obs[0] if obs else None
        return cls(world=len(obs), loss_ranks=len(with_loss), loss_bad=loss_bad,
                   loss_mean=sum(with_loss) / len(with_loss) if with_loss and not loss_bad else math.nan,
                   bad=bad, checked=sum(1 for n in norms if n is not None), grad_proxy=proxy,
                   faults_fired=sum(o.faults_fired for o in obs), samples_rejected=sum(o.samples_rejected for o in obs),
                   lr=first.lr if first else math.nan, prev_grad_norm=first.prev_grad_norm if first else math.nan,
                   prev_applied_sq=sum(o.prev_applied_sq for o in obs),
                   compute_mean=sum(times) / len(times) if obs and timed else None,
                   loss_max=extreme(losses), grad_norm_max=extreme(norms),
                   compute_max=extreme(times), compute_min=extreme(times, -1.0),
                   clock_max=extreme([o.clock for o in obs]), clock_min=extreme([o.clock for o in obs], -1.0))
