"""What one rank accumulates over the micro-batches of one optimizer step, until AGREE reads it.

LOSS adds each micro-batch's loss and a non-finite flag into one device tensor; BACKWARD keeps each local
gradient's norm (a 0-dim device tensor, one reduction kernel per gradient); BATCH keeps the samples' dataset
indices, the ones the sanitiser set aside and the data position. Nothing here reads a device value: AGREE
copies the device parts into its row (trainguard.isolation), and the one host synchronisation of a healthy
step happens there. A new tally starts with every step.
"""
from __future__ import annotations

import time
from typing import Any, Sequence

import torch

from trainguard.data import DataPosition
from trainguard.isolation import FIELDS, F


class StepTally:
    def __init__(self, device: torch.device):
        self.device = device
        self.acc: torch.Tensor | None = None       # [loss_sum, loss_nonfinite] on device
        self.grad_norms: list[torch.Tensor] = []   # 0-dim norms of the local gradients
        self.micro = 0                             # micro-batches whose loss was seen
        self.grad_hooks = 0                        # gradients seen
        self.sample_ids: list[int] = []
        self.ids_taken = 0                         # of sample_ids, those a recorded micro-batch holds
        self.rejected: list = []
        self.position: DataPosition | None = None

    def batch(self, sample_ids: list[int], position: DataPosition, rejected: Sequence = ()) -> None:
        self.sample_ids.extend(sample_ids)
        self.rejected.extend(rejected)
        self.position = position

    def loss(self, loss: torch.Tensor, checking: bool) -> None:
        """One micro-batch's loss (device-side flags only: no host sync)."""
        self.micro += 1
        if checking and isinstance(loss, torch.Tensor):
            if self.acc is None:
                # on the device the collective backend reduces (gloo: CPU; NCCL: the rank's GPU)
                self.acc = torch.zeros(2, dtype=torch.float64, device=self.device)
            value = loss.detach().to(self.device, torch.float64).sum()
            self.acc[0].add_(value)
            self.acc[1].add_((~torch.isfinite(value)).to(torch.float64))

    def grad(self, grad: torch.Tensor) -> None:
        """One local gradient, before any data-parallel reduction (NaN/Inf propagate into its norm)."""
        self.grad_norms.append(local_norm(grad.detach()))
        self.grad_hooks += 1

    def take_ids(self) -> list[int]:
        """The sample ids since the last call (a recorded micro-batch's own)."""
        ids = list(self.sample_ids[self.ids_taken:])
        self.ids_taken = len(self.sample_ids)
        return ids

    def grad_sq(self) -> torch.Tensor | None:
        """The squared norm of every local gradient of the step, on the device (None: none seen)."""
        if not self.grad_norms:
            return None
        by_dtype: dict = {}
        for n in self.grad_norms:
            by_dtype.setdefault(n.dtype, []).append(n)
        sq = [torch.stack(ns).to(self.device, torch.float64).square().sum() for ns in by_dtype.values()]
        return sq[0] if len(sq) == 1 else torch.stack(sq).sum()

    def row(self, agreement, fired: int, compute_s: float, lr: float | None, deferred) -> Any:
        """AGREE's row of this rank (trainguard.isolation.FIELDS, then the agreement's extra columns): the
        host-known fields in one small copy, then the device values -- the loss, the gradients' norm, the previous
        step's pending norms (``deferred``: trainguard.metricline.DeferredLine) -- copied in, never read here."""
        host = [0.0] * len(FIELDS) + [float("nan")] * len(agreement.extra)
        host[F["micro_batches"]] = self.micro
        host[F["grad_checked"]] = self.grad_hooks
        host[F["faults_fired"]] = fired
        host[F["samples_rejected"]] = len(self.rejected)
        host[F["clock"]] = time.time()  # (each rank's own: the per-rank heartbeat metric)
        host[F["compute_s"]] = compute_s
        host[F["lr"]] = float("nan") if lr is None else float(lr)
        pending = deferred.norm
        if not isinstance(pending, torch.Tensor):
            host[F["prev_grad_norm"]] = float("nan") if pending is None else float(pending)
        row = agreement.row(host)
        if self.acc is not None:
            row[F["loss_sum"]] = self.acc[0]
            row[F["loss_nonfinite"]] = self.acc[1]
        grad_sq = self.grad_sq()
        if grad_sq is not None:
            row[F["grad_sq"]] = grad_sq
        if isinstance(pending, torch.Tensor):
            row[F["prev_grad_norm"]] = pending.detach().reshape(()).to(self.device, torch.float64)  # no sync
        applied = deferred.applied_sq
        row[F["prev_applied_sq"]] = float("nan") if applied is None else applied.detach().reshape(()).to(
            self.device, torch.float64)  # (likewise)
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


def local_norm(grad: torch.Tensor) -> torch.Tensor:
    """2-norm of one gradient, NaN/Inf-propagating. fp16 is reduced into fp32 (a large scaled
    gradient's norm can exceed fp16's 65504 and would read as a false Inf); other dtypes use the
    multi-tensor kernel clip_grad_norm_ uses, several times faster than vector_norm(dtype=...)."""
    if grad.dtype == torch.float16 or not hasattr(torch, "_foreach_norm"):
        return torch.linalg.vector_norm(grad, dtype=torch.float32)
    return torch._foreach_norm([grad])[0]
