"""The local-gradient check and the gradient hooks, installed in the one order both adapters need.

The guard's non-finite check reads each rank's *local* gradients, before any data-parallel reduction (DeepSpeed's at
ZeRO 0-3, megatron's DDP). Where the adapter names the framework's own reduction point -- the method that receives a
bucket, or every gradient at the accumulation boundary, before reducing it (``at_reduction``) -- the check runs there:
one multi-tensor norm per call, no Python per parameter (trainguard.step.tally.LocalGrads.add_all). Elsewhere
(ZeRO-3, a framework's internals not recognised, a clip by value, which would turn an Inf finite first) it is a
tensor hook per parameter. Per parameter, in this order:

1. the configured gradient faults (``inf_grad``, ``fp16_overflow``): first, so that what follows sees what they did;
2. the guard's non-finite check (``StepGuard.on_backward``), on the raw local gradient, when no reduction point;
3. any further hooks of the adapter (DeepSpeed: clipping by value), still before the reduction.
"""
from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch

# (an object, the name of its method that reduces local gradients, which of its call's arguments are those gradients)
ReductionPoint = tuple[object, str, Callable[..., Sequence[torch.Tensor]]]


def install(named: Sequence[tuple[str, torch.nn.Parameter]], faults, step_number: Callable[[], int],
            check: Callable | None = None, extra: Iterable[Callable] = (), at_reduction: Sequence[ReductionPoint] = (),
            check_all: Callable[[Sequence[torch.Tensor]], None] | None = None) -> list:
    """Register the hooks on every parameter of ``named`` (``(name, parameter)``, trainable ones), or the check at
    ``at_reduction`` (``check_all``: what receives the gradients there); returns the handles (``.remove()``).
    ``faults``: the FaultInjector or None; ``step_number``: the step the current backward belongs to."""
    targets = faults.grad_targets([n for n, _ in named]) if faults is not None else {}
    extra = list(extra)
    handles = [Before(obj, name, which, check_all) for obj, name, which in at_reduction] \
        if check is not None and at_reduction and check_all is not None else []
    if handles:
        check = None
    for name, p in named:
        specs = targets.get(name)
        if specs:
            handles.append(p.register_hook(lambda g, specs=specs: faults.grad(step_number(), specs, g)))
        if check is not None:
            handles.append(p.register_hook(check))
        for hook in extra:
            handles.append(p.register_hook(hook))
    return handles


def where(handles: Sequence) -> str:
    """Where the check of ``handles`` (install's) runs: the run_start record's ``grad_check_point``."""
    points = sorted({f"{type(h.obj).__name__}.{h.name}" for h in handles if isinstance(h, Before)})
    return "local, before the data-parallel reduction: " + (
        f"one multi-tensor norm a call of {', '.join(points)}" if points else "a tensor hook a parameter")


class Before:
    """``obj.<name>`` wrapped on the instance: ``check(which(*args, **kwargs))`` first, then the framework's own call.
    ``remove()`` puts the original back."""

    def __init__(self, obj, name: str, which: Callable[..., Sequence[torch.Tensor]], check: Callable):
        self.obj, self.name = obj, name
        self.had = name in vars(obj)
        original = getattr(obj, name)

        def checked(*args, **kwargs):
            check(which(*args, **kwargs))
            return original(*args, **kwargs)

        self.original = original
        setattr(obj, name, checked)

    def remove(self) -> None:
        if self.had:
            setattr(self.obj, self.name, self.original)
        else:
            vars(self.obj).pop(self.name, None)
