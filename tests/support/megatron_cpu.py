"""Test-only: just enough of CUDA on a CPU for megatron-core 0.16.1 to 0.19.2 (shared/docs/PLATFORM.md).

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
    torch.cuda.Stream = _Stream                 # (0.19: DDP's grad sync waits on the current stream)
    torch.cuda.current_stream = lambda *a, **k: _Stream()
    torch.cuda.set_stream = lambda *a, **k: None
    torch.cuda.stream = lambda s=None: _Stream()
    _CudaToCpu().__enter__()  # for the rest of the process


class _Stream:
    """A CUDA stream that is no stream: Megatron-LM's DDP side stream and ``torch.cuda.stream(s)``."""

    def __init__(self, *a, **k):
        pass

    def wait_stream(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def record_event(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Properties:
    name, major, minor, total_memory, multi_processor_count = "cpu (test layer)", 9, 0, 24 << 30, 1


def enable_lm() -> None:
    """``enable()`` plus what Megatron-LM's training loop (``megatron.training``, megatron-core 0.17.1 and 0.19.2)
    asks of CUDA beyond megatron-core (shared/docs/PLATFORM.md, per megatron function)."""
    import os

    enable()
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")   # validate_args with TP > 1
    torch.cuda.is_available = lambda: True                      # initialize_megatron asserts it
    torch.cuda.device_count = lambda: 1                         # parallel groups, TP RNG seeding
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.get_device_properties = lambda *a, **k: _Properties()
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.get_device_name = lambda *a, **k: _Properties.name
    torch.cuda.empty_cache = lambda: None
    torch.cuda.memory_allocated = lambda *a, **k: 0
    torch.cuda.max_memory_allocated = lambda *a, **k: 0
    torch.cuda.memory_reserved = lambda *a, **k: 0
    torch.cuda.max_memory_reserved = lambda *a, **k: 0
    torch.cuda.reset_peak_memory_stats = lambda *a, **k: None
    torch._dynamo.config.disable = True                         # _warmup_jit_function compiles fusions
    import megatron.core.datasets.utils as dutils

    dutils.compile_helpers = lambda: None                       # the wheel ships the built helper


def enable_lm_training() -> None:
    """After ``megatron.training`` is imported: the CPU generator stands in for CUDA's, and building
    the data iterators after a ``--load`` draws from it once (CUDA's generator would be untouched);
    keep its state around that, so that a resumed run repeats an uninterrupted one exactly."""
    from megatron.training import training

    build = training.build_train_valid_test_data_iterators

    def build_train_valid_test_data_iterators(*args, **kwargs):
        state = torch.get_rng_state()
        try:
            return build(*args, **kwargs)
        finally:
            torch.set_rng_state(state)

    training.build_train_valid_test_data_iterators = build_train_valid_test_data_iterators
