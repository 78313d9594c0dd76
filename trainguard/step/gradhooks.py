"""Per-parameter gradient hooks, installed in the one order both adapters need.

A tensor hook on a parameter sees that rank's *local* gradient, before any data-parallel
reduction (DeepSpeed's at ZeRO 0-3, megatron's DDP). Per parameter, in this order:

1. the configured gradient faults (``inf_grad``, ``fp16_overflow``): first, so that what
   follows sees what they did;
2. the guard's non-finite check (``StepGuard.on_backward``), on the raw local gradient;
3. any further hooks of the adapter (DeepSpeed: clipping by value), still before the reduction.
"""
from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch


def install(named: Sequence[tuple[str, torch.nn.Parameter]], faults, step_number: Callable[[], int],
            check: Callable | None = None, extra: Iterable[Callable] = ()) -> list:
    """Register the hooks on every parameter of ``named`` (``(name, parameter)``, trainable ones);
    returns the handles. ``faults``: the FaultInjector or None; ``step_number``: the step the
    current backward belongs to."""
    targets = faults.grad_targets([n for n, _ in named]) if faults is not None else {}
    extra = list(extra)
    handles = []
    for name, p in named:
        specs = targets.get(name)
        if specs:
            handles.append(p.register_hook(lambda g, specs=specs: faults.grad(step_number(), specs, g)))
        if check is not None:
            handles.append(p.register_hook(check))
        for hook in extra:
            handles.append(p.register_hook(hook))
    return handles
