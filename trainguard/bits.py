"""A tensor's bits read as integers: what the replica check sums and the bit-flip fault flips, read one way."""
from __future__ import annotations

import torch

INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # element size -> the integer of that width


def as_ints(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits read as integers of the same width (a view: writing it writes ``t``)."""
    return t.view(INT[t.element_size()])
