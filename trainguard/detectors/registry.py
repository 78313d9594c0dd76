"""Built-in detectors that drive a ladder, in one shape -- found, not listed.

A module in ``trainguard/detectors/`` that defines ``REGISTRATION`` is one. The guard builds it when its
config section (``detectors.<key>``) is enabled, lets it add one column to the per-step AGREE table (a value
each rank computes on its device: no extra collective, no host sync), and hands it every rank's row at
DECIDE; its verdicts go to the policy with the others. A verdict whose ``anomaly`` is a member of
:class:`trainguard.events.Anomaly` climbs ``recovery.ladders[anomaly]`` (its ``detail["onset_step"]``,
when given, is where a rollback must go back to before; ``detail["suspect"]``, a reason, puts the named ranks'
hosts into ``suspect_hosts.json``, which the launch scripts exclude on a restart); its record is
``Record(anomaly)``.

Two optional methods, called on every rank alike (collectives allowed): ``exchange(step, ctx)`` at DECIDE before
``observe`` (``ctx``: :class:`trainguard.verdicts.PeerContext`; ``peer_replay.py`` replays micro-batches for
its peers there), and ``explain(step, verdicts, group)`` after ``observe`` found something (``replica.py`` names the
tensors that differ there, with one object gather on a mismatch step only).

So a new detector touches three files: its module here (the detector and its ``REGISTRATION``), its
config section and ladder default (``trainguard/config.py``), and its ``Anomaly`` and ``Record``
members (``trainguard/events.py``, with its row in docs/events.md). ``replica.py`` is one.
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from trainguard.verdicts import RankObservation, Verdict


class LadderDetector(Protocol):
    """What the guard calls; every rank calls it the same way, so every rank gets the same verdicts."""

    def attach_model(self, model) -> None:
        """The model the adapter guards (its parameters are this rank's own)."""

    def local(self, step: int) -> Any:
        """This rank's value for the column at AGREE of ``step``: a 0-dim tensor on the collective's device, a
        float, or None (nothing this step: NaN in the table). Called only when the registration has a column."""

    def sampled(self, step: int) -> bool:
        """Whether every rank's row must travel this step (the same answer on every rank). Above 64 ranks a healthy
        step reduces a fixed-size summary instead of the rows (trainguard.agreement): ``observe`` sees every rank's
        row only on the steps this says; a detector with a column and no ``sampled`` has the rows every step."""

    def observe(self, step: int, obs: Sequence[RankObservation], coords: Sequence) -> list[Verdict]:
        """The gathered rows (``obs[r].extra[column]``: every rank's on a ``sampled`` step) and every rank's
        coordinates in, verdicts out. Pure."""

    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


@dataclass(frozen=True)
class Registration:
    key: str                                    # its section: cfg.detectors.<key> (with an ``enabled`` field)
    build: Callable[[Any, Any], LadderDetector]  # (its config section, the guard's device) -> the detector
    column: str | None = None                   # the AGREE table column it fills, if any


def registrations() -> list[Registration]:
    """Every registered detector, in module-name order (the same on every rank: the table's columns)."""
    import trainguard.detectors as pkg

    found = []
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        if info.name in ("base", "registry"):
            continue
        reg = getattr(importlib.import_module(f"{pkg.__name__}.{info.name}"), "REGISTRATION", None)
        if isinstance(reg, Registration):
            found.append(reg)
    return found


REGISTERED = tuple(registrations())  # (found once, at import)
COLUMNS = tuple(r.column for r in REGISTERED if r.column)  # after isolation.FIELDS, in this order
