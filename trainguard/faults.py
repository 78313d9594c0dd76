"""Config-driven fault injection: NaN loss, Inf gradient, poisoned batch at step k on rank r.

Refused by the config unless ``allow_faults`` is true. The injector only answers "does a fault fire
here?" and applies it to the tensor it is handed; the adapter calls it at the loop points (FORWARD,
LOSS, BACKWARD). It is usable without the guard, so the demo can inject the same faults into a
plain DeepSpeed run for comparison.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from trainguard.config import FaultSpec


class FaultInjector:
    def __init__(self, faults: Sequence[FaultSpec], rank: int):
        self.faults = [f for f in faults if f.rank == rank]
        self.rank = rank
        self.fired: list[tuple[int, str]] = []  # (step, type), for the record

    def _due(self, kind: str, step: int) -> list[FaultSpec]:
        return [f for f in self.faults if f.type == kind and f.step == step]

    def fired_in(self, step: int) -> int:
        return sum(1 for s, _ in self.fired if s == step)

    # FORWARD ---------------------------------------------------------------------------------
    def batch(self, step: int, inputs: Any) -> tuple[Any, bool]:
        """nan_batch: every floating-point tensor in ``inputs`` filled with NaN. Returns
        ``(inputs, needs_output_poison)``: an integer-only batch cannot hold NaN, so the caller
        poisons the first leaf module's output for this forward instead."""
        if not self._due("nan_batch", step):
            return inputs, False
        self.fired.append((step, "nan_batch"))
        found = [False]

        def poison(x):
            if isinstance(x, torch.Tensor) and x.is_floating_point():
                found[0] = True
                return torch.full_like(x, float("nan"))
            if isinstance(x, dict):
                return type(x)((k, poison(v)) for k, v in x.items())
            if isinstance(x, (list, tuple)):
                return type(x)(poison(v) for v in x)
            return x

        inputs = poison(inputs)
        return inputs, not found[0]

    # LOSS ------------------------------------------------------------------------------------
    def loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        if not self._due("nan_loss", step):
            return loss
        self.fired.append((step, "nan_loss"))
        return loss * float("nan")  # keeps the graph; backward then yields NaN gradients too

    # BACKWARD --------------------------------------------------------------------------------
    def grad_targets(self, names: Sequence[str]) -> dict[str, list[FaultSpec]]:
        """Which parameters get an inf_grad hook (default: the first parameter)."""
        targets: dict[str, list[FaultSpec]] = {}
        for f in self.faults:
            if f.type != "inf_grad":
                continue
            name = f.param or names[0]
            if name not in names:
                raise ValueError(f"trainguard.faults: inf_grad param '{name}' is not a parameter of the "
                                 f"model (first few: {', '.join(list(names)[:5])})")
            targets.setdefault(name, []).append(f)
        return targets

    def grad(self, step: int, spec_list: Sequence[FaultSpec], grad: torch.Tensor) -> torch.Tensor:
        if not any(f.step == step for f in spec_list):
            return grad
        if (step, "inf_grad") not in self.fired:
            self.fired.append((step, "inf_grad"))
        out = grad.clone()
        out.view(-1)[0] = float("inf")
        return out
