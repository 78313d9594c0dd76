"""nan_batch's poison where a batch has no floating-point tensor to poison (token ids): NaN into the output of the
model's first leaf module, the whole batch or one row of it -- applied by the adapter, which owns the forward, and
carried with a micro-batch to a peer's replay (trainguard.replay.p2p)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OutputPoison:
    """nan_batch on an integer-only batch: NaN into the output of the model's first leaf module, in
    row ``row`` of the batch (None: every row). The adapter applies it (it owns the forward)."""

    row: int | None = None

    def for_row(self, row: int) -> "OutputPoison | None":
        """What a replay of that one row (a batch of one) must poison."""
        return OutputPoison() if self.row is None or self.row == row else None

    def apply(self, output: torch.Tensor) -> torch.Tensor:
        return nan_rows(output, self.row)


class PoisonFirstLeaf:
    """Around one forward of ``module``: ``poison`` (an :class:`OutputPoison`) applied to the output of
    the first leaf module that runs -- nan_batch on an integer-only batch (both adapters)."""

    def __init__(self, module: torch.nn.Module, poison):
        self.module = module
        self.poison = poison
        self.handles: list = []
        self.done = False

    def __enter__(self):
        def hook(mod, args, output):
            if self.done or not isinstance(output, torch.Tensor) or not output.is_floating_point():
                return None
            self.done = True
            return self.poison.apply(output)

        for m in self.module.modules():
            if not list(m.children()):
                self.handles.append(m.register_forward_hook(hook))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        return False


def nan_rows(t: torch.Tensor, row: int | None) -> torch.Tensor:
    """NaN in row ``row`` of ``t`` (None: everywhere), keeping the autograd graph."""
    if row is None:
        return t + float("nan")
    out = t.clone()
    if out.dim() and out.shape[0] > row:
        out[row] = float("nan")
    return out
