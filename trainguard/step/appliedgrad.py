"""The gradient the optimizer applied, measured where the framework clipped it.

The framework clips inside its own step (DeepSpeed's ZeRO optimizers unscale and clip the
partitioned fp32 gradients; megatron clips its main gradients) and then calls the inner torch
optimizer. A step post-hook on that inner optimizer sees exactly the gradients the update used (Adam, AdamW,
DeepSpeed's fused and CPU Adam leave them as they were), its work queued after the update's -- not between the
decision and the update's launch, where it would grow with the parameters (an optimizer that writes into its
gradients -- SGD with Nesterov momentum, Muon -- is measured before its step, as all were). On a
step whose metric line is written (armed by the driver), the hook adds up their squared norm on the
device (no host read); the value rides in the next step's AGREE table, whose sum over ranks is the
global squared norm of what was applied -- the line's ``grad_norm_clipped``, measured rather than
computed as ``min(raw, limit)``.

Elements held by several ranks (replicated gradients: ZeRO-0, or a model-parallel duplicate) must
count once: ``replication`` divides this rank's sum by how many ranks hold the same elements, or
``grads`` returns only the gradients this rank owns for the norm (megatron's own deduplicated list).
"""
from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch

from trainguard.step.tally import norms_f32


class AppliedGradMeter:
    def __init__(self, optimizers: Iterable[torch.optim.Optimizer], replication: float = 1.0,
                 grads: Callable[[torch.optim.Optimizer], Sequence[torch.Tensor]] | None = None):
        self.replication = float(replication)
        self._grads = grads
        self._armed = False
        self._sq: torch.Tensor | None = None
        self._handles = [o.register_step_pre_hook(self._after_step) if _changes_grads(o) else
                         o.register_step_post_hook(self._after_step) for o in optimizers]

    def arm(self) -> None:
        """Measure the coming step (every inner ``step()`` call until :meth:`take`: DeepSpeed steps its
        inner optimizer once per parameter group)."""
        self._armed, self._sq = True, None

    def take(self) -> torch.Tensor | None:
        """This rank's squared norm of the applied gradients (a device scalar), None when no inner
        step ran (a skipped step)."""
        sq, self._sq, self._armed = self._sq, None, False
        return sq

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _after_step(self, opt, args, kwargs) -> None:
        if not self._armed:
            return
        if self._grads is not None:
            grads = [g for g in self._grads(opt) if g is not None]
        else:
            grads = [p.grad for group in opt.param_groups for p in group["params"] if p.grad is not None]
        if not grads:
            return
        sq = torch.stack(norms_f32(grads)).to(torch.float64).square().sum()  # (four launches, whatever the count)
        sq = sq / self.replication if self.replication != 1 else sq
        self._sq = sq if self._sq is None else self._sq + sq


def _changes_grads(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt``'s step writes into the gradients it steps with (torch's SGD with Nesterov momentum, Muon): then
    they are measured before the step, not after it."""
    return "Muon" in type(opt).__name__ or (isinstance(opt, torch.optim.SGD) and any(
        g.get("nesterov") for g in opt.param_groups))
