"""The megatron-core releases trainguard is tested with, and a clear refusal outside them.

The adapter reaches into megatron-core's optimizers, DDP buffers, schedules and (for Megatron-LM's
loop) ``megatron.training``'s functions by name; a release outside the tested range may have moved
any of them, and a guard that half-works is worse than none. ``TRAINGUARD_ALLOW_UNTESTED_MEGATRON=1``
runs anyway (the ``run_start`` record says the version)."""
from __future__ import annotations

import os

from trainguard.errors import UnsupportedSetup

__all__ = ["CORE", "LM", "check"]

# (lowest, highest) tested, inclusive, as (major, minor, patch); the tests run every bound
CORE = ((0, 16, 1), (0, 19, 2))   # megatron_hooks.install over megatron-core's own parts
LM = ((0, 17, 1), (0, 19, 2))     # Megatron-LM's loop (megatron.training, in the megatron-core wheel)
ESCAPE = "TRAINGUARD_ALLOW_UNTESTED_MEGATRON"


def _parse(version: str) -> tuple[int, ...]:
    release = version.split("+")[0].split("rc")[0]
    parts = []
    for piece in release.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts + [0] * (3 - len(parts)))


def check(version: str, what: str = "megatron-core") -> None:
    """Raise :class:`UnsupportedSetup` naming the version, the tested range and the way out, when
    ``version`` is outside the range of ``what`` ("megatron-core" or "Megatron-LM")."""
    low, high = CORE if what == "megatron-core" else LM
    if low <= _parse(version) <= (high[0], high[1], 10 ** 6) or os.environ.get(ESCAPE) == "1":
        return
    show = ".".join
    raise UnsupportedSetup(
        f"trainguard's {what} support is tested with megatron-core {show(map(str, low))} to "
        f"{high[0]}.{high[1]}.x; this is megatron-core {version}. Use a tested release, or set {ESCAPE}=1 to run "
        f"the guard untested (it reaches into megatron-core's optimizers, DDP buffers and schedules by name)")
