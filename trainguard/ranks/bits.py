"""A tensor's bits read as integers: what the replica check sums (``digest``) and the bit-flip fault flips, read one way."""
from __future__ import annotations

from typing import Sequence

import torch

INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # element size -> the integer of that width


def as_ints(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits read as integers of the same width (a view: writing it writes ``t``)."""
    return t.view(INT[t.element_size()])


MOD = 2 ** 52


def digest(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The parameters' bits as integers, summed modulo 2**52, as a 0-dim float64 tensor on their device (no
    host sync). Tensors whose storage is not plain (ZeRO-3's empty placeholders) add nothing."""
    total = None
    for p in params:
        t = p.detach()
        if not t.numel() or t.element_size() not in INT:
            continue
        s = as_ints(t.contiguous()).sum(dtype=torch.int64).remainder(MOD)
        total = s if total is None else (total + s).remainder(MOD)
    if total is None:
        return torch.zeros((), dtype=torch.float64)
    return total.to(torch.float64)
