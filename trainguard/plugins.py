"""Extension points a user reaches from the block: record callbacks, detectors and sinks, each
named by a ``"type"`` -- a registered name or ``"package.module:Name"`` -- and built with its
``options``. One small Protocol each; a bad name, a missing attribute, options the class does not
take, or an object that does not fit its Protocol is a ConfigError naming the key.

    "callbacks": ["mypkg.alerts:page_oncall"],
    "detectors": {"custom": [{"type": "mypkg.detectors:LossFloor", "options": {"floor": 0.5}}]},
    "metrics":   {"sinks":  [{"type": "mypkg.sinks:Statsd", "options": {"host": "10.0.0.1"}}]}

A custom detector runs on every rank with the same gathered observations (so it must be pure and
deterministic, like the built-in ones); its verdicts are written as ``custom_alert`` records and
exported -- they alert, they do not drive the recovery ladders (whose classes are closed). Every rank's
observations travel every step for it; above 64 ranks that grows with the world (trainguard.step.agreement), so a
detector that can work on the step's summary says ``needs = "summary"`` and gets a
:class:`trainguard.ranks.reduced.Summary` instead (run_start lists the detectors that read every rank's rows).
"""
from __future__ import annotations

import importlib
from typing import Any, Callable, Iterable, Protocol, Sequence, runtime_checkable

from trainguard.verdicts import RankObservation, Verdict
from trainguard.errors import ConfigError


@runtime_checkable
class Sink(Protocol):
    """Mirrors the log (rank 0): every metric line and every record."""

    def metric(self, step: int, values: dict[str, Any]) -> None: ...
    def event(self, step: int, event: str, ranks, action: str | None, detail: dict) -> None: ...
    def close(self) -> None: ...


@runtime_checkable
class Detector(Protocol):
    """Every rank's observations of one step in, verdicts out (pure: no I/O, no collectives)."""

    def observe(self, step: int, obs: Sequence[RankObservation]) -> Iterable[Verdict]: ...
    # optional: ``needs = "summary"`` -> ``observe(step, summary)`` with a trainguard.ranks.reduced.Summary


def _tensorboard(**options):
    from trainguard.metrics.tensorboard import TensorBoardSink

    return TensorBoardSink(**options)


def _prometheus(**options):
    from trainguard.metrics.prometheus import PrometheusSink

    return PrometheusSink(**options)


def _wandb(**options):
    from trainguard.config import WandbConfig
    from trainguard.metrics.wandb import WandbSink

    return WandbSink(WandbConfig(**options))


SINKS: dict[str, Callable[..., Sink]] = {"tensorboard": _tensorboard, "prometheus": _prometheus, "wandb": _wandb}
DETECTORS: dict[str, Callable[..., Detector]] = {}


def split_spec(spec: str, key: str) -> tuple[str, str]:
    """``"package.module:attr"`` -> ``(module, attr)``; a ConfigError naming ``key`` otherwise."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError([(key, f"{spec!r} is neither a registered name nor of the form 'package.module:name'")])
    return module_name, attr


def resolve(spec: str, key: str) -> Any:
    """``"package.module:attr"`` -> the object; a ConfigError naming ``key`` otherwise."""
    module_name, attr = split_spec(spec, key)
    try:
        obj = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import failure is the user's path
        raise ConfigError([(key, f"cannot import {module_name!r} ({type(e).__name__}: {e})")]) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError([(key, f"{module_name!r} has no attribute {attr!r}")])
        obj = getattr(obj, part)
    return obj


def resolve_callable(spec: str, key: str) -> Callable:
    obj = resolve(spec, key)
    if not callable(obj):
        raise ConfigError([(key, f"{spec!r} is not callable")])
    return obj


def build(spec, registry: dict[str, Callable], protocol: type, key: str) -> Any:
    """An extension from its ``{"type", "options"}`` spec (a trainguard.config.PluginSpec)."""
    factory = registry.get(spec.type) or resolve_callable(spec.type, f"{key}.type")
    try:
        obj = factory(**spec.options)
    except (TypeError, ValueError) as e:
        raise ConfigError([(f"{key}.options", f"{spec.type}: {e}")]) from None
    if not isinstance(obj, protocol):
        missing = [m for m in ("metric", "event", "close", "observe") if hasattr(protocol, m) and
                   not callable(getattr(obj, m, None))]
        raise ConfigError([(f"{key}.type", f"{spec.type} does not implement {protocol.__name__} (missing: "
                                           f"{', '.join(missing)})")])
    return obj
