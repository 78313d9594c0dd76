"""Per-rank flag vectors -> one collective -> every rank holds every rank's observation.

The AGREE collective is an all-reduce (SUM) of a ``[world, FIELDS]`` float64 tensor in which each
rank has filled only its own row. It works on every backend (gloo has no all_gather_into_tensor on
every version), moves ``world * len(FIELDS) * 8`` bytes (64 KB at 1,000 ranks), and, because the
result is bit-identical everywhere, every rank reaches the same verdict without a second round.
NaN and Inf survive the sum in their own row (other ranks contribute exact zeros there).
"""
from __future__ import annotations

import math
import socket
from dataclasses import asdict, dataclass
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
        return asdict(self)


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


def agree(row: torch.Tensor, group=None) -> list[list[float]]:
    """The one per-step collective. ``row`` is this rank's ``[len(FIELDS)]`` float64 vector on the
    device the collective backend wants. Returns the table as host floats (the one host sync)."""
    if not _distributed():
        return [row.tolist()]
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    table = torch.zeros(world, row.numel(), dtype=torch.float64, device=row.device)
    table[rank].copy_(row)
    dist.all_reduce(table, op=dist.ReduceOp.SUM, group=group)
    return table.tolist()  # the single host synchronisation of a healthy step


def observations(table: Sequence[Sequence[float]], loss_scale: float = 1.0,
                 grad_divisor: float = 1.0, extra: Sequence[str] = ()) -> list[RankObservation]:
    """Turn the gathered table into per-rank observations.

    ``grad_sq`` holds squared norms of the gradients as autograd produced them: scaled by the fp16
    loss scale and divided by the gradient-accumulation steps. ``loss_scale`` and ``grad_divisor``
    undo that so the reported local norm is comparable to DeepSpeed's global one. ``extra``: the names of
    the columns after FIELDS (the registered detectors', trainguard.detectors.registry), in order.
    """
    out = []
    for rank, row in enumerate(table):
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


def all_true(flag: bool) -> bool:
    """Every rank's ``flag``, and-ed: one small all-reduce (MIN) on the collective's device -- cheap enough to run
    each step while something is pending (an object gather pickles, and on NCCL syncs the host twice)."""
    if not _distributed():
        return bool(flag)
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def distributed() -> bool:
    """Whether a default process group is up."""
    return _distributed()
