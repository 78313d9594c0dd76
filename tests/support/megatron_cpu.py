"""Test-only: just enough of CUDA on a CPU for megatron-core 0.16.1 (shared/docs/PLATFORM.md).

Never imported by the shipped packages. ``enable()`` (idempotent, per process):

- a ``TorchFunctionMode`` that turns ``device="cuda"`` / ``device=<int>`` / ``torch.device("cuda")``
  into the CPU, makes ``Tensor.cuda()`` a no-op, and answers ``Tensor.type()`` with the
  ``torch.cuda.*`` names megatron's optimizers and clipping check for;
- ``torch.cuda.current_device`` -> 0 (the mode maps it to the CPU), ``synchronize`` a no-op;
- CUDA RNG calls -> the CPU generator, so megatron's own ``CudaRNGStatesTracker`` tracks CPU
  states (the tensor-parallel RNG fork works, and its states can be checkpointed).
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

_ENABLED = False


def _cpu(device):
    if device is None:
        return None
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        if func in (torch.Tensor.to,) and args and len(args) > 1 and not isinstance(args[1], torch.dtype) and \
                not isinstance(args[1], torch.Tensor):
            args = (args[0], _cpu(args[1]), *args[2:])
        return func(*args, **kwargs)


def enable() -> None:
    global _ENABLED
    if _ENABLED:
        return
    _ENABLED = True
    torch.cuda.current_device = lambda: 0
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.manual_seed = torch.manual_seed
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    import megatron.core.tensor_parallel.random as mrandom

    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    _CudaToCpu().__enter__()  # for the rest of the process
