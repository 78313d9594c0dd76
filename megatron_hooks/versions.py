"""The megatron-core releases trainguard supports, and a clear refusal outside them: the support matrix's
rows for megatron-core (the adapter) and Megatron-LM's loop (``megatron.training``, in the same wheel),
trainguard/releases.json, checked by trainguard.releases.

The adapter reaches into megatron-core's optimizers, DDP buffers, schedules and (for Megatron-LM's loop)
``megatron.training``'s functions by name; a release outside the matrix may have moved any of them.
``TRAINGUARD_ALLOW_UNTESTED=megatron-core`` (or ``megatron-lm``; the older ``TRAINGUARD_ALLOW_UNTESTED_MEGATRON=1``
too) runs anyway, and the ``run_start`` record says the version."""
from __future__ import annotations

from trainguard.ports import releases
from trainguard.errors import UnsupportedSetup

__all__ = ["check", "UnsupportedSetup"]

_KEYS = {"megatron-core": "megatron-core", "Megatron-LM": "megatron-lm"}


def check(version: str, what: str = "megatron-core") -> bool:
    """Raise :class:`UnsupportedSetup` naming the version, the supported ranges and the override, when
    ``version`` is outside the matrix for ``what`` ("megatron-core" or "Megatron-LM"); False when let through
    untested."""
    return releases.check(_KEYS[what], version)
