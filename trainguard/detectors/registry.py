"""Every built-in detector that feeds the ladders, in one shape -- found, not listed.

A module in ``trainguard/detectors/`` that defines ``REGISTRATION`` is one: the non-finite check
(``nonfinite.py``), the loss and gradient statistics (``spikes.py``: loss spike, gradient norm, loss trend,
which read one another), the sampled probes' judges (``activation.py``, ``attention.py``), the replica check
(``replica.py``) and the peer replay (``peer_replay.py``). The guard builds each one whose config section
(``detectors.<key>``) is enabled (``key`` None: always), in ``order``, and calls it at DECIDE through a
:class:`Decide` -- the step as every rank agreed it -- in two rounds:

- ``early(step, ctx)``, before the step's object gather, from what the agreement brought (the summary, the
  rows where they travelled): what it finds decides whether the step gathers, localises and replays;
- ``observe(step, ctx)``, after it: with every named rank's objects (``ctx.everyone``), the weights check's
  outcome (``ctx.weights``) and the probes' values (``ctx.probed``).

Each returns new verdicts (kept in ``ctx.found``, in order); a non-finite finding is one verdict, merged into
``ctx.nonfinite``. A verdict whose ``anomaly`` is a member of :class:`trainguard.events.Anomaly` climbs
``recovery.ladders[anomaly]`` (its ``detail["onset_step"]``, when given, is where a rollback must go back to
before; ``detail["suspect"]``, a reason, puts the named ranks' hosts into ``suspect_hosts.json``, which the
launch scripts exclude on a restart); its record is ``Record(anomaly)``.

Optional, each called on every rank alike (collectives allowed where said): ``attach_model(model)``;
``local(step)`` (with a ``column``: this rank's value for one added column of the per-step AGREE table -- no
extra collective, no host sync) and ``sampled(step)`` (the steps every rank's row must travel above 64 ranks);
``exchange(step, peer_ctx)`` just before ``observe`` (collectives; ``peer_ctx``:
:class:`trainguard.verdicts.PeerContext` -- ``peer_replay.py`` replays micro-batches for its peers there);
``explain(step, verdicts, group)`` after ``observe`` found something (collectives; ``replica.py`` names the
tensors that differ there); ``rewound(step, to_step, restart)``, ``lr_lowered()``, ``precision_changed()`` (what
the run did since: a rollback, an LR cut, a precision switch); ``state_dict`` / ``load_state_dict`` (kept in
the guard's checkpointed state).

So a new detector touches four files: its module here (the detector and its ``REGISTRATION``), its
config section and ladder default (``trainguard/config/detectors.py``, ``trainguard/config/recovery.py``),
and its ``Anomaly`` and ``Record`` members (``trainguard/events.py``, with its row in docs/events.md).
``replica.py`` is one.
"""
from __future__ import annotations

import functools
import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from trainguard.verdicts import Verdict


@dataclass
class Decide:
    """The step at DECIDE, the same on every rank: what the detectors read, and what they found so far."""

    view: Any                        # trainguard.step.agreement.StepView: .summary (every step), the rows where they travelled
    coords: Sequence                 # trainguard.ranks.isolation.RankCoords of every rank
    scaled: bool = False             # an fp16 dynamic loss scale is on (gradient overflows are its routine)
    lr: float | None = None          # rank 0's LR of the step (what every rank's detectors read)
    lr_ratio: Callable[[], float | None] = lambda: None  # the LR now over the LR a lookback before (records it: once)
    nonfinite: Verdict | None = None  # the non-finite finding, merged across detectors
    found: list[Verdict] = field(default_factory=list)  # every other verdict, in the order found
    everyone: dict | None = None     # after the gather: {rank: its objects} (the ranks named, or every rank)
    weights: str | None = None       # after the gather: the weights check's outcome ("healthy", "damaged", None)
    probed: dict = field(default_factory=dict)  # after the gather: {"activation": ..., "entropy": ...} when sampled

    @property
    def summary(self):
        return self.view.summary

    @functools.cached_property
    def rows(self) -> list:
        """Every rank's row on the steps they travel (trainguard.step.agreement), else this rank's and the named."""
        return list(self.view)


class LadderDetector(Protocol):
    """What the guard calls; every rank calls it the same way, so every rank gets the same verdicts. Both rounds
    are optional: a detector has ``early``, ``observe`` or both."""

    def early(self, step: int, ctx: Decide) -> list[Verdict]:
        """Before the gather: from the agreement alone. Pure."""

    def observe(self, step: int, ctx: Decide) -> list[Verdict]:
        """After the gather (``ctx.rows[r].extra[column]``: every rank's value on a ``sampled`` step). Pure."""

    def clear(self, step: int, summary) -> bool:
        """Optional: True when nothing it could find this step asks for the update to be refused -- the step may
        then launch before it is decided (trainguard.step.launchgate; its verdicts one step late). A detector
        without it keeps every step decided before the update."""


@dataclass(frozen=True)
class Registration:
    key: str | None                             # its section: cfg.detectors.<key> (with ``enabled``); None: always
    build: Callable[[Any, Any], LadderDetector]  # (its config section -- or cfg.detectors --, the device) -> it
    column: str | None = None                   # the AGREE table column it fills, if any
    order: int = 100                            # its turn in each round (the built-ins first; then by module name)


def registrations() -> list[Registration]:
    """Every registered detector in its turn (the same on every rank: the table's columns)."""
    import trainguard.detectors as pkg

    found = []
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        if info.name in ("base", "registry"):
            continue
        reg = getattr(importlib.import_module(f"{pkg.__name__}.{info.name}"), "REGISTRATION", None)
        if isinstance(reg, Registration):
            found.append(reg)
    return sorted(found, key=lambda r: r.order)  # (stable: module-name order within a turn)


@functools.cache
def registered() -> tuple[Registration, ...]:
    """Found once, at the first guard (not at import: a detector module imported first would miss itself)."""
    return tuple(registrations())


def columns() -> tuple[str, ...]:
    """The registered detectors' AGREE columns, after isolation.FIELDS, in this order."""
    return tuple(r.column for r in registered() if r.column)
