"""The SPAM-style reset of an optimizer's moments after a spike (recovery.reset_moments)."""
from __future__ import annotations


def zero_adam_moments(optimizer) -> int:
    """Zero Adam's moment estimates (SPAM-style reset after a spike) of a torch optimizer; returns how
    many elements were zeroed (0: no moments where they were looked for)."""
    import torch

    n = 0
    for state in getattr(optimizer, "state", {}).values():
        for key in ("exp_avg", "exp_avg_sq"):
            t = state.get(key) if isinstance(state, dict) else None
            if isinstance(t, torch.Tensor):
                t.zero_()
                n += t.numel()
    return n
