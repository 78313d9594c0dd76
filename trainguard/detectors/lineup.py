"""The step's detectors, built from the block and called in their turn: the registered ones that feed the ladders
(trainguard.detectors.registry: found, not listed) and yours (``detectors.custom``, which alert only).

The guard holds one :class:`Lineup` and asks it at each loop point what the detectors have to say: their columns
of the AGREE row (``local``), whether the step needs every rank's row (``wants_rows``), what they find before and
after the step's object gather (``early``, ``observe``), your detectors' alerts (``custom_verdicts``), and what the
run did since (``rewound``, ``tell``). Every rank calls each of these alike.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from trainguard.detectors.registry import Decide, columns, registered
from trainguard.detectors.spikes import Spikes
from trainguard.ranks.isolation import FIELDS
from trainguard.plugins import DETECTORS, Detector, build


class Lineup:
    """Built once per rank from ``cfg`` (the whole block) on ``device`` (where their device values live)."""

    def __init__(self, cfg, device: torch.device):
        self.device = device
        self.custom = [build(spec, DETECTORS, Detector, f"trainguard.detectors.custom[{i}]")
                       for i, spec in enumerate(cfg.detectors.custom)]
        # every detector that feeds the ladders, in its turn; the statistics' windows also answer the guard's
        # questions (a healthy loss, the loss median, a rise's onset)
        self.registered = [(reg, reg.build(getattr(cfg.detectors, reg.key) if reg.key else cfg.detectors, device))
                           for reg in registered() if reg.key is None or getattr(cfg.detectors, reg.key).enabled]
        self.stats: Spikes = next(det for _, det in self.registered if isinstance(det, Spikes))
        self.columns = columns()
        self.column_at = {name: len(FIELDS) + i for i, name in enumerate(self.columns)}  # their AGREE columns
        self.exchanging = any(hasattr(det, "exchange") for _, det in self.registered)  # (a peer replay)
        # the detectors that read every rank's rows each step: yours without ``needs = "summary"``, a registered one
        # with a column but no ``sampled`` (trainguard.detectors.registry)
        self.rows_every_step = [type(d).__name__ for d in self.custom if getattr(d, "needs", "rows") != "summary"] + \
            [reg.key for reg, det in self.registered if reg.column and not hasattr(det, "sampled")]

    def attach_model(self, model: torch.nn.Module) -> None:
        for _, det in self.registered:
            if hasattr(det, "attach_model"):
                det.attach_model(model)

    # ------------------------------------------------------------------ AGREE
    def local(self, step: int, row: dict) -> None:
        """This rank's value of each registered column, into ``row`` (device values copied, never read here)."""
        for reg, det in self.registered:
            value = det.local(step) if reg.column else None
            if value is not None:
                row[self.column_at[reg.column]] = value.to(self.device, torch.float64) \
                    if isinstance(value, torch.Tensor) else float(value)

    def sampled(self, step: int) -> bool:
        """Whether a sampled check runs at ``step`` (one that compares every rank: the replica check, the peer
        replay)."""
        return any(getattr(det, "sampled", lambda s: False)(step) for _, det in self.registered)

    def wants_rows(self, step: int) -> bool:
        """Whether this step needs every rank's row (the summary way gathers it only then): a sampled check that
        compares every rank, or a detector of yours that reads the rows."""
        return bool(self.rows_every_step) or self.sampled(step)

    def clear(self, step: int, summary) -> bool:
        """Whether every registered detector says that nothing it could find this step would refuse the update (its
        ``clear``; one without it says no: trainguard.step.launchgate). (A sampled step is not clear either: the
        caller's wants_rows says so.)"""
        return all(getattr(det, "clear", None) is not None and det.clear(step, summary) for _, det in self.registered)

    # ------------------------------------------------------------------ DECIDE
    def early(self, step: int, ctx: Decide) -> None:
        """Before the step's object gather: what the agreement shows (into ``ctx.found`` / ``ctx.nonfinite``)."""
        for _, det in self.registered:
            if hasattr(det, "early"):
                ctx.found += det.early(step, ctx)

    def observe(self, step: int, ctx: Decide, peer_context: Callable[[], Any], group, suspect) -> None:
        """After it: the named ranks' objects, the weights check, the probes. ``peer_context()`` builds the peer
        replay's context (once, when a detector exchanges); ``suspect(step, rank, why)`` names a rank's host."""
        peer = None
        for _, det in self.registered:
            if hasattr(det, "exchange"):  # (detectors.peer_replay replays for its peers, every rank alike)
                peer = peer or peer_context()
                det.exchange(step, peer)
            found = det.observe(step, ctx) if hasattr(det, "observe") else []
            if found and hasattr(det, "explain"):  # (every rank alike: the verdicts come from the gathered table)
                det.explain(step, found, group)
            for v in found:  # (a detector that names a rank for sure: its host goes to suspect_hosts.json)
                for r in v.ranks if v.detail.get("suspect") else ():
                    suspect(step, r, f"{v.anomaly}: {v.detail['suspect']}")
            ctx.found += found

    def custom_verdicts(self, step: int, summary, rows) -> list:
        """Your detectors' verdicts (they alert; the ladders act on the built-in classes only)."""
        return [v for det in self.custom
                for v in det.observe(step, summary if getattr(det, "needs", "rows") == "summary" else rows)]

    # ------------------------------------------------------------------ what the run did since
    def rewound(self, step: int, to_step: int, restart: bool) -> None:
        for _, det in self.registered:
            if hasattr(det, "rewound"):
                det.rewound(step, to_step, restart)

    def tell(self, what: str) -> None:
        """``lr_lowered`` or ``precision_changed``, to each detector that listens."""
        for _, det in self.registered:
            if hasattr(det, what):
                getattr(det, what)()

    def checks_run(self) -> dict:
        """How many times each sampled check ran (run_end: what says a quiet run was checked, not skipped)."""
        return {reg.key: det.checks for reg, det in self.registered if reg.key and hasattr(det, "checks")}

    # ------------------------------------------------------------------ state (in the guard's)
    def state_dict(self) -> dict:
        return {reg.key: det.state_dict() for reg, det in self.registered if reg.key and hasattr(det, "state_dict")}

    def load_state_dict(self, state: dict) -> None:
        for reg, det in self.registered:
            if reg.key and reg.key in state and hasattr(det, "load_state_dict"):
                det.load_state_dict(state[reg.key])
