"""Make DeepSpeed's own optimizer take its own "skip this step" path, on every rank.

DeepSpeed already knows how to skip a step: its fp16/bf16 and ZeRO optimizers have an overflow
path that clears gradients and partitions without touching weights or optimizer state, after which
the engine counts the step in ``skipped_steps`` and leaves the LR scheduler alone. What DeepSpeed
lacks is a way to *ask* for it (and ZeRO-0 fp32 with a torch optimizer has no such path at all:
there NaN goes straight into the weights). :func:`forced_skip` patches, on the optimizer *instance*
and only for the duration of one ``engine.step()``, the method that decides "overflow", so that the
real cleanup code of that DeepSpeed version runs. Each strategy is registered by class name (the
MRO is walked), so a subclass inherits its parent's strategy and an unknown optimizer is refused
at ``initialize`` time with a clear error rather than mishandled at step time.

fp16 note: taking the overflow path also lets DeepSpeed's dynamic loss scaler count an overflow
(halve the scale, per its hysteresis), which is what DeepSpeed does by itself for a non-finite
gradient; the guard only makes the decision collective and attributable.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

from trainguard.errors import UnsupportedSetup

_STRATEGIES: dict[str, Callable] = {}


def strategy(*class_names: str):
    def register(fn):
        for name in class_names:
            _STRATEGIES[name] = fn
        return fn
    return register


# DeepSpeed's optimizers whose step ends in one launch of the inner torch optimizer, with no state changed before it on
# a bf16/fp32 run (trainguard.step.launchgate: the decision taken there); their skip path is the engine's "overflow"
# (and a torch optimizer of its own: ZeRO 0, fp32)
GATED = ("DeepSpeedZeroOptimizer", "BF16_Optimizer", "FP16_UnfusedOptimizer")


def find_strategy(optimizer) -> Callable:
    for cls in type(optimizer).__mro__:
        if cls.__name__ in _STRATEGIES:
            return _STRATEGIES[cls.__name__]
    raise UnsupportedSetup(
        f"trainguard cannot skip an optimizer step for {type(optimizer).__name__} (engine.optimizer); "
        f"supported: {', '.join(sorted(_STRATEGIES))}. Set trainguard.detectors.nonfinite.enabled to "
        "false to run without the guard, or use one of those optimizers.")


@contextlib.contextmanager
def _patched(obj, name: str, value) -> Iterator[None]:
    """Shadow a method on one instance; restore the class's method afterwards."""
    had = name in vars(obj)
    old = vars(obj).get(name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if had:
            setattr(obj, name, old)
        else:
            delattr(obj, name)


@strategy("DeepSpeedZeroOptimizer")  # ZeRO 1 and 2, fp32/bf16/fp16
@contextlib.contextmanager
def _zero_1_2(opt) -> Iterator[None]:
    def check_overflow(partition_gradients=True):
        opt.overflow = True

    # DeepSpeed 0.19 clears the flag, then checks (check_grad_overflow, any dtype); 0.16-0.17 check only under
    # fp16, and their bf16/fp32 step reads the flag as it stands -- so it is set here too, and put back after
    # (nothing clears it there: left set, every later step would skip)
    before, opt.overflow = opt.overflow, True
    try:
        with _patched(opt, "check_overflow", check_overflow), _patched(opt, "check_grad_overflow", True):
            yield
    finally:
        opt.overflow = before


@strategy("DeepSpeedZeroOptimizer_Stage3")
@contextlib.contextmanager
def _zero_3(opt) -> Iterator[None]:
    if not hasattr(opt, "_loss_scale_update_and_overflow_cleanup"):  # DeepSpeed 0.16-0.17: as ZeRO 1-2 there
        with _zero_1_2(opt):
            yield
        return

    def overflow_check_and_loss_scale_update(update_scale=True):
        opt.overflow = True
        if not update_scale:
            return True
        return opt._loss_scale_update_and_overflow_cleanup()

    with _patched(opt, "_overflow_check_and_loss_scale_update", overflow_check_and_loss_scale_update):
        yield


@strategy("BF16_Optimizer")  # ZeRO 0 with bf16
@contextlib.contextmanager
def _bf16(opt) -> Iterator[None]:
    def step(closure=None):  # the body of its own invalid-norm branch
        opt.overflow = True
        opt._global_grad_norm = float("inf")
        opt.clear_hp_grads()
        opt.clear_lp_grads()

    # (the engine reads the flag when the attribute exists; DeepSpeed 0.16's BF16_Optimizer has none, and one
    # left behind would count every later step as skipped)
    with _patched(opt, "step", step), _patched(opt, "overflow", True):
        yield


@strategy("FP16_Optimizer", "FP16_UnfusedOptimizer")  # ZeRO 0, fp16 (and bf16 with a non-fused torch optimizer)
@contextlib.contextmanager
def _fp16(opt) -> Iterator[None]:
    if not hasattr(opt, "_skip_invalid_grad_norm"):  # DeepSpeed 0.16-0.17: its overflow check says yes
        checker = opt.overflow_checker
        with _patched(checker, "has_overflow", lambda *a, **k: True), _patched(checker, "check", lambda *a, **k: True):
            yield
        return

    def step(closure=None):
        return opt._skip_invalid_grad_norm()

    with _patched(opt, "step", step):
        yield


@strategy("Optimizer")  # a plain torch optimizer: ZeRO 0, fp32
@contextlib.contextmanager
def _torch(opt) -> Iterator[None]:
    # The engine reads ``optimizer.overflow`` when the attribute exists; with it True the engine
    # counts a skipped step and leaves the scheduler alone, then clears param.grad itself.
    def step(closure=None):
        return None

    with _patched(opt, "step", step), _patched(opt, "overflow", True):
        yield


def forced_skip(optimizer):
    """Context manager: inside it, the optimizer's next ``step()`` takes its skip path."""
    return find_strategy(optimizer)(optimizer)
