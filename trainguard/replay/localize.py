"""Where a non-finite value came first, from flags taken during the training forward itself.

A forward hook on every module records whether its output was finite -- a device flag, no host
synchronisation; the flags are read only on a non-finite step. The first non-finite one, in the order the
outputs were produced (a module's output comes after its children's), is where the NaN/Inf appeared. For a
framework whose forward cannot be replayed alone (megatron's pipeline schedule), this is the localisation;
DeepSpeed's path replays the micro-batch instead (trainguard.replay.probes.first_nonfinite).
"""
from __future__ import annotations

from typing import Sequence

import torch


class OutputFlags:
    """``modules``: ``(path, module, global_layer or None)`` in any order; ``stage``: the pipeline stage."""

    def __init__(self, modules: Sequence[tuple[str, torch.nn.Module, int | None]], stage: int = 0):
        self.stage = stage
        self.names = [path for path, _, _ in modules]
        self.layer_of = {path: layer for path, _, layer in modules}
        self.flags: list[tuple[int, torch.Tensor]] = []
        self.handles = [m.register_forward_hook(self._hook(i)) for i, (_, m, _) in enumerate(modules)]

    def _hook(self, idx: int):
        def hook(module, args, output):
            if not module.training:
                return None
            t = output[0] if isinstance(output, (tuple, list)) and output else output
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.flags.append((idx, torch.isfinite(t.detach()).all()))
            return None
        return hook

    def first_nonfinite(self) -> dict:
        """The first module whose output was non-finite. Anomaly steps only: reading the flags syncs."""
        for pos, (idx, ok) in enumerate(self.flags):
            if not bool(ok):
                name = self.names[idx]
                return {"module": name, "global_layer": self.layer_of.get(name), "pipeline_stage": self.stage,
                        "origin_order": [self.stage, pos], "modules_checked": len(self.names)}
        return {"module": None, "note": "every module output was finite (the loss or a gradient was not)"}

    def reset(self) -> None:
        self.flags.clear()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
