"""What one rank accumulates over the micro-batches of one optimizer step, until AGREE reads it.

LOSS adds each micro-batch's loss and a non-finite flag into one device tensor; BACKWARD keeps each local
gradient's norm (:class:`LocalGrads`: multi-tensor where the framework reduces, else a hook a gradient); BATCH
keeps the samples' dataset indices, the ones the sanitiser set aside and the data position. Nothing here reads a
device value: AGREE copies the device parts into its row (trainguard.ranks.isolation), and the one host
synchronisation of a healthy step happens there. A new tally starts with every step.
"""
from __future__ import annotations

import time
from typing import Any, Sequence

import torch

from trainguard.data.position import DataPosition
from trainguard.ranks.isolation import FIELDS, F


class LocalGrads:
    """The local gradients' norms of the step being computed, before any data-parallel reduction. Two ways in, chosen
    by the adapter (trainguard.step.gradhooks): ``add_all``, where the framework reduces -- a bucket, or every gradient
    at the accumulation boundary: one multi-tensor norm launch and one stack, whatever the number of gradients -- and
    ``add``, the per-parameter tensor hook's target where no such point is known (one Python call and one kernel a
    gradient). Nothing read on the host, no gradient held (the framework may reduce or free it right after). One per
    guard, across steps: the step's tally takes what it holds at AGREE, and a new step starts it afresh."""

    __slots__ = ("norms", "acc", "count")

    def __init__(self):
        self.norms: list[torch.Tensor] = []  # 0-dim fp32 norms (the per-parameter hooks')
        self.acc: torch.Tensor | None = None  # add_all's squared norms, summed as they come (float64)
        self.count = 0                       # gradients seen

    def add(self, grad: torch.Tensor | None) -> None:
        if grad is not None:
            self.norms.append(torch._foreach_norm((grad,), 2, dtype=_F32)[0] if _FOREACH_DTYPE else
                              torch.linalg.vector_norm(grad, dtype=_F32))  # (torch's own: no call of ours)
            self.count += 1

    def add_all(self, grads: Sequence) -> None:
        """Every local gradient the framework is about to reduce (tensors; anything else -- DeepSpeed's sparse
        gradients' wrapper -- is passed over)."""
        dense = [g for g in grads if isinstance(g, torch.Tensor)]
        self.count += len(dense)
        if dense and dense[0].device.type == "cpu":  # (a CPU's norm of one large bucket: ~2x its pieces' time)
            dense = [p for g in dense for p in (g.reshape(-1).split(_CPU_PIECE) if g.numel() > _CPU_PIECE else (g,))]
        if dense:  # (summed now, where the framework reduces: nothing left for AGREE but to copy it)
            sq = torch.stack(norms_f32(dense)).to(torch.float64).square().sum()
            self.acc = sq if self.acc is None else self.acc.add(sq)

    def clear(self) -> None:
        self.norms, self.acc, self.count = [], None, 0

    def sq(self, device: torch.device) -> torch.Tensor | None:
        """The squared norm of every gradient seen, a float64 device scalar (None: none seen): the reduction points'
        sum as it stands, the hooks' norms stacked (four kernels, whatever the number of gradients)."""
        hooks = torch.stack(self.norms).to(device, torch.float64).square().sum() if self.norms else None
        acc = self.acc.to(device) if self.acc is not None else None
        return acc if hooks is None else hooks if acc is None else acc + hooks


class StepTally:
    def __init__(self, device: torch.device, grads: LocalGrads | None = None):
        self.device = device
        self.loss_sum: torch.Tensor | None = None  # the micro-batches' losses, summed as they come (float64)
        self.loss_bad: torch.Tensor | None = None  # how many of them were not finite
        self.grads = grads if grads is not None else LocalGrads()  # the local gradients' norms (its hooks' target)
        self.grads.clear()
        self.micro = 0                             # micro-batches whose loss was seen
        self.sample_ids: list[int] = []
        self.ids_taken = 0                         # of sample_ids, those a recorded micro-batch holds
        self.rejected: list = []
        self.position: DataPosition | None = None

    def batch(self, sample_ids: list[int], position: DataPosition, rejected: Sequence = ()) -> None:
        self.sample_ids.extend(sample_ids)
        self.rejected.extend(rejected)
        self.position = position

    def loss(self, loss: torch.Tensor, checking: bool) -> None:
        """One micro-batch's loss, kept on the device (summed and flagged once, at AGREE: no host sync)."""
        self.micro += 1
        if checking and isinstance(loss, torch.Tensor):  # (summed and flagged now: AGREE only copies them)
            each = loss.detach().to(self.device, torch.float64) if loss.dim() == 0 else \
                loss.detach().sum(dtype=torch.float64).to(self.device)
            bad = each.mul(0).nan_to_num(1.0)  # (0 * a finite loss is 0; else NaN -> 1)
            first = self.loss_sum is None
            self.loss_sum, self.loss_bad = (each, bad) if first else (self.loss_sum + each, self.loss_bad + bad)

    def take_ids(self) -> list[int]:
        """The sample ids since the last call (a recorded micro-batch's own)."""
        ids = list(self.sample_ids[self.ids_taken:])
        self.ids_taken = len(self.sample_ids)
        return ids

    def row(self, agreement, fired: int, compute_s: float, lr: float | None, deferred) -> Any:
        """AGREE's row of this rank (trainguard.ranks.isolation.FIELDS, then the agreement's extra columns): the
        host-known fields in one small copy, then the device values -- the loss, the gradients' norm, the previous
        step's pending norms (``deferred``: trainguard.step.metricline.DeferredLine) -- copied in, never read here."""
        host = [0.0] * len(FIELDS) + [float("nan")] * len(agreement.extra)
        host[F["micro_batches"]] = self.micro
        host[F["grad_checked"]] = self.grads.count
        host[F["faults_fired"]] = fired
        host[F["samples_rejected"]] = len(self.rejected)
        host[F["clock"]] = time.time()  # (each rank's own: the per-rank heartbeat metric)
        host[F["compute_s"]] = compute_s
        host[F["lr"]] = float("nan") if lr is None else float(lr)
        pending = deferred.norm
        if not isinstance(pending, torch.Tensor):
            host[F["prev_grad_norm"]] = float("nan") if pending is None else float(pending)
        applied = deferred.applied_sq
        if applied is None:
            host[F["prev_applied_sq"]] = float("nan")
        row = agreement.row(host)
        at, values = [], []  # (the device values: one stack, one indexed write into the row)
        if self.loss_sum is not None:
            at += [F["loss_sum"], F["loss_nonfinite"]]
            values += [self.loss_sum, self.loss_bad]
        grad_sq = self.grads.sq(self.device)
        if grad_sq is not None:
            at.append(F["grad_sq"])
            values.append(grad_sq)
        if isinstance(pending, torch.Tensor):  # (made float64 device scalars when the line was held)
            at.append(F["prev_grad_norm"])
            values.append(pending.to(self.device))
        if applied is not None:
            at.append(F["prev_applied_sq"])
            values.append(applied.to(self.device))
        if values:
            row.index_put_((_index(tuple(at), self.device),), torch.stack(values))
        return row

    def where(self) -> dict | None:
        return self.position.as_dict() if self.position else None

    def rank_line(self, rank: int, own) -> dict | None:
        """This rank's line of the step (metrics.rank_jsonl): its own loss and norm (``own``: its row as agreed,
        None where it did not travel), its samples and data position."""
        if own is None:
            return None
        return {"rank": rank, "local_loss": own.loss, "local_grad_norm": own.grad_norm, "sample_ids": self.sample_ids,
                "position": self.where()}


_F32 = torch.float32
_INDEXES: dict = {}  # (the row's device-value columns, device) -> their index tensor, made once


def _index(at: tuple, device: torch.device) -> torch.Tensor:
    """The columns as a device tensor, made once for each combination (a few in a run): a list copied to a GPU
    each step would wait for the whole backward first -- a copy from pageable memory is a host sync."""
    key = (at, str(device))
    if key not in _INDEXES:
        _INDEXES[key] = torch.tensor(at, device=device)
    return _INDEXES[key]

_CPU_PIECE = 1 << 18  # elements


def _foreach_has_dtype() -> bool:
    try:
        torch._foreach_norm((torch.ones(1, dtype=torch.float16),), 2, dtype=_F32)
        return True
    except (TypeError, RuntimeError, AttributeError):  # (an older torch: one norm a tensor instead)
        return False


_FOREACH_DTYPE = _foreach_has_dtype()


def norms_f32(tensors) -> list[torch.Tensor]:
    """2-norms of ``tensors`` (any dtypes, one device), accumulated and returned in fp32 whatever their dtype (a
    large scaled fp16 gradient's norm can exceed fp16's 65504 and would read as a false Inf), NaN/Inf-propagating,
    in one multi-tensor launch where torch has it."""
    if _FOREACH_DTYPE:
        return list(torch._foreach_norm(tuple(tensors), 2, dtype=_F32))
    return [torch.linalg.vector_norm(t, dtype=_F32) for t in tensors]
