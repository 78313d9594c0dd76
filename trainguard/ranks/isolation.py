"""Per-rank flag vectors, the collectives that combine them, and every rank's coordinates.

A rank's AGREE row is ``FIELDS`` (then the registered detectors' columns). The table of every rank's row is
an all-reduce (SUM) of a ``[world, n]`` float64 tensor in which each rank filled only its own row: it works
on every backend (gloo has no all_gather_into_tensor on every version), and, because the result is
bit-identical everywhere, every rank reaches the same verdict without a second round. NaN and Inf survive
the sum in their own row (other ranks contribute exact zeros there). It moves ``world * n * 8`` bytes, so
trainguard.step.agreement takes it every step only up to 64 ranks; above, a healthy step reduces a fixed-size
summary instead (trainguard.ranks.reduced).
"""
from __future__ import annotations

import math
import socket
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from trainguard.verdicts import RankObservation

# Columns of the gathered table. Appending a field is compatible; reordering is not.
FIELDS = ("loss_sum", "micro_batches", "loss_nonfinite", "grad_sq", "grad_checked", "faults_fired",
          "samples_rejected", "prev_grad_norm", "clock", "prev_applied_sq",
          "compute_s", "lr")
F = {name: i for i, name in enumerate(FIELDS)}


@dataclass(frozen=True)
class RankCoords:
    """Where a rank sits: data/tensor/pipeline coordinates and its host."""

    rank: int
    dp: int
    tp: int
    pp: int
    host: str
    local_rank: int
    cp: int = 0      # context-parallel rank (megatron)
    ep: int = 0      # expert-parallel rank (megatron)

    def as_dict(self) -> dict:
        return dict(self.__dict__)  # (flat fields: dataclasses.asdict's deep copy costs ~35 us a rank)


def gather_coords(dp: int, tp: int, pp: int, local_rank: int, group=None, cp: int = 0,
                  ep: int = 0) -> list[RankCoords]:
    """Once at BEGIN: every rank learns every rank's coordinates and host (object gather)."""
    mine = RankCoords(rank=_rank(), dp=dp, tp=tp, pp=pp, host=socket.gethostname(), local_rank=local_rank,
                      cp=cp, ep=ep)
    if not _distributed():
        return [mine]
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, mine, group=group)
    return list(out)


FEW = 64  # named ranks up to which their objects come one broadcast each; above, one all-gather


class TorchCollective:
    """The AGREE collectives over torch.distributed (``group`` None: the world); a simulation
    (bench/scale.py) hands :class:`trainguard.step.agreement.Agreement` another object with these three methods."""

    def __init__(self, group=None):
        self.group = group

    def table(self, row: torch.Tensor) -> torch.Tensor:
        """Every rank's row: an all-reduce (SUM) of a ``[world, n]`` float64 table in which each rank filled its
        own row (exact: every other rank adds zeros). Left on the device. A group of one: the row itself."""
        world = dist.get_world_size(self.group) if _distributed() else 1
        if world == 1:
            return row.reshape(1, -1)
        table = torch.zeros(world, row.numel(), dtype=torch.float64, device=row.device)
        table[dist.get_rank(self.group)].copy_(row)
        dist.all_reduce(table, op=dist.ReduceOp.SUM, group=self.group)
        return table

    def reduce(self, sums: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The fixed-size summary (trainguard.ranks.reduced): SUM of the float64 sums, MAX of the int64 keys."""
        if _distributed() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=self.group)
            dist.all_reduce(keys, op=dist.ReduceOp.MAX, group=self.group)
        return sums, keys

    def objects(self, obj, ranks: Sequence[int] | None = None) -> dict:
        """``{rank: its obj}``: every rank's (``ranks`` None: one object all-gather) or only the named ranks'
        (one object broadcast from each: the others' unpickling does not grow with the world)."""
        if not _distributed():
            return {0: obj} if ranks is None or 0 in ranks else {}
        if ranks is None or len(set(ranks)) > FEW:  # (many named -- every rank's fp16 overflow --: one gather)
            every = dict(enumerate(gather_objects(obj, self.group)))
            return every if ranks is None else {r: every[r] for r in sorted(set(ranks)) if r in every}
        me = dist.get_rank(self.group)
        out = {}
        for r in sorted(set(ranks)):
            box = [obj if r == me else None]
            src = dist.get_global_rank(self.group, r) if self.group is not None else r
            dist.broadcast_object_list(box, src=src, group=self.group)
            out[r] = box[0]
        return out


def observations(table: Sequence[Sequence[float]], loss_scale: float = 1.0,
                 grad_divisor: float = 1.0, extra: Sequence[str] = (),
                 ranks: Sequence[int] | None = None) -> list[RankObservation]:
    """Turn the gathered table into per-rank observations.

    ``grad_sq`` holds squared norms of the gradients as autograd produced them: scaled by the fp16
    loss scale and divided by the gradient-accumulation steps. ``loss_scale`` and ``grad_divisor``
    undo that so the reported local norm is comparable to DeepSpeed's global one. ``extra``: the names of
    the columns after FIELDS (the registered detectors', trainguard.detectors.registry), in order. ``ranks``:
    whose rows ``table`` holds (default: every rank's, in rank order).
    """
    out = []
    for rank, row in zip(ranks if ranks is not None else range(len(table)), table):
        micro = int(row[F["micro_batches"]])
        loss = row[F["loss_sum"]] / micro if micro else float("nan")
        grad_norm = None
        if row[F["grad_checked"]] > 0:
            sq = row[F["grad_sq"]]
            grad_norm = math.sqrt(sq) / loss_scale * grad_divisor if math.isfinite(sq) else sq
        out.append(RankObservation(rank=rank, loss=loss, micro_batches=micro,
                                   loss_nonfinite=int(row[F["loss_nonfinite"]]), grad_norm=grad_norm,
                                   faults_fired=int(row[F["faults_fired"]]),
                                   samples_rejected=int(row[F["samples_rejected"]]),
                                   prev_grad_norm=row[F["prev_grad_norm"]], clock=row[F["clock"]],
                                   prev_applied_sq=row[F["prev_applied_sq"]], compute_s=row[F["compute_s"]],
                                   lr=row[F["lr"]],
                                   extra={name: row[len(FIELDS) + i] for i, name in enumerate(extra)}))
    return out


def broadcast_from_rank0(obj):
    """Rank 0's ``obj`` on every rank (one object broadcast; the others' arguments are ignored)."""
    if not _distributed():
        return obj
    box = [obj if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def collective_device(accelerator: str | None = None) -> torch.device:
    """Where the AGREE tensor must live for the default group's backend: the current CUDA device
    under NCCL, the CPU under gloo/ccl, else ``accelerator`` (the CPU when there is none)."""
    backend = dist.get_backend() if _distributed() else None
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if backend in ("gloo", "ccl") or accelerator is None:
        return torch.device("cpu")
    return torch.device(accelerator)


def gather_objects(obj, group=None) -> list:
    """Off the per-step path (anomaly steps, the snapshot tier's set-up and paced snapshots): a variable-size gather."""
    if not _distributed():
        return [obj]
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def rank() -> int:
    """This process's rank in the default group (0 when not distributed)."""
    return _rank()


def world() -> int:
    return dist.get_world_size() if _distributed() else 1


def barrier() -> None:
    if _distributed():
        dist.barrier()


def failures_of(action, passthrough: tuple = ()) -> list[dict]:
    """Every rank: run ``action()`` -- a recovery's load, an insurance save -- whatever it raises (torch's distributed
    checkpoint raises BaseExceptions), and agree on the outcome: ``[]`` when it succeeded on every rank (one flag
    all-reduced), else every rank's error, gathered and grouped ``[{"error", "ranks"}]`` (a thousand ranks failing
    alike is one entry). ``passthrough``: exceptions that are not a failure of the action (raised on)."""
    error = None
    try:
        action()
    except (KeyboardInterrupt, SystemExit, GeneratorExit, *passthrough):
        raise
    except BaseException as e:  # noqa: BLE001 - the caller goes on from a failure; it must not die of it
        error = f"{type(e).__name__}: {str(e)[-1500:]}"
    if all_true(error is None):
        return []
    grouped: dict[str, list[int]] = {}
    for r, e in enumerate(gather_objects(error)):
        if e:
            grouped.setdefault(e, []).append(r)
    return [{"error": e, "ranks": ranks} for e, ranks in grouped.items()]


def all_true(flag: bool) -> bool:
    """Every rank's ``flag``, and-ed: one small all-reduce (MIN) on the collective's device -- cheap enough to run
    each step while something is pending (an object gather pickles, and on NCCL syncs the host twice)."""
    if not _distributed():
        return bool(flag)
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def maxima(values: Sequence[float]) -> list[float]:
    """Every rank's ``values``, element-wise maxima (a minimum: negate it): one small all-reduce (MAX), whatever the
    world's size."""
    if not _distributed():
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def distributed() -> bool:
    """Whether a default process group is up."""
    return _distributed()
