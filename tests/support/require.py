"""A test's environment that may be missing: skipped with the reason where it is -- or, when ``TRAINGUARD_REQUIRE``
names it (CI sets it: .ci/run), failed, so that a claim CI is meant to prove is never carried by a skip.

Capabilities: ``megatron_lm`` (Megatron-LM's checkouts beside the repository, ../shared/third_party, and the
releases of megatron-core they run), ``megatron_releases`` (megatron-core 0.16.1 and 0.17.1 beside the installed
one: scripts/setup.sh), ``slurm`` (a single-host Slurm: scripts/get_slurm.sh, root), ``tmpfs`` (mount(8), root),
``extras`` (what the ``[test]`` extras install: DeepSpeed, transformers, Accelerate, megatron-core,
prometheus_client -- a broken import of one must fail CI, not skip whole modules green), ``promtool``
(scripts/get_promtool.sh)."""
from __future__ import annotations

import os

import pytest

KNOWN = ("megatron_lm", "megatron_releases", "slurm", "tmpfs", "extras", "promtool")


def required() -> set[str]:
    names = {c.strip() for c in os.environ.get("TRAINGUARD_REQUIRE", "").split(",") if c.strip()}
    unknown = names - set(KNOWN)
    if unknown:
        raise ValueError(f"TRAINGUARD_REQUIRE names {sorted(unknown)}: known are {', '.join(KNOWN)}")
    return names


def unavailable(capability: str, reason: str, module: bool = False) -> None:
    """``capability`` is missing here, for ``reason``: skip -- or fail, when TRAINGUARD_REQUIRE names it."""
    assert capability in KNOWN, capability
    if capability in required():
        pytest.fail(f"TRAINGUARD_REQUIRE names {capability}, and it is missing: {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=module)


def imported(module: str, capability: str = "extras"):
    """``module`` imported -- or, where it does not import, :func:`unavailable` (a module-level skip, or a failure
    naming the module and its error when TRAINGUARD_REQUIRE names ``capability``)."""
    import importlib

    try:
        return importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - any import failure is what is reported
        unavailable(capability, f"could not import {module!r}: {type(e).__name__}: {e}", module=True)
