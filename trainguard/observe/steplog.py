"""How the guard writes what a run and its steps found: one record each (trainguard.observe.records shapes them, EventLog
writes them), an alert folded into its open incident (trainguard.observe.incidents); the run's start and end, a step's faults,
set-aside samples, verdicts, your detectors' alerts and stragglers, the framework's own skip, an abort's report."""
from __future__ import annotations

from typing import Callable

from trainguard import __version__

from trainguard.observe import records
from trainguard.config import config_hash
from trainguard.errors import TrainguardAbort
from trainguard.observe.eventlog import EventLog
from trainguard.events import Action, Record
from trainguard.observe.incidents import Incidents
from trainguard.decisions import Decision, anomaly_class
from trainguard.verdicts import Verdict

ALERT = records.ALERT


class StepLog:
    def __init__(self, rank: int, cfg, coords_of: Callable[[int], dict], no_ids_hint: str | None = None):
        self.rank, self.cfg, self.coords_of = rank, cfg, coords_of
        # a verdict's note where no loader named its samples, with the adapter's advice
        self.no_ids = records.NO_SAMPLE_IDS + (f"; {no_ids_hint}" if no_ids_hint else "")
        self.events = EventLog(rank)
        self.incidents = Incidents(cfg.metrics.incident_gap) if cfg.metrics.incident_gap else None

    def emit(self, step: int, record: Record, ranks=(), action: str | None = None, detail: dict | None = None,
             rank_local: bool = False, **extra) -> None:
        """Write one record (trainguard.observe.eventlog.EventLog.emit): the one way anything is logged."""
        self.events.emit(step, record, ranks, action, detail, rank_local=rank_local, **extra)

    def run_start(self, world: int, coords: list, framework: dict, probes, agreement, rows_every_step: list) -> None:
        """Rank 0: the run's identity -- trainguard's release, the block's hash, every rank's coordinates, the faults,
        the probes, how the step's agreement travels -- and the framework's facts."""
        self.emit(0, Record.RUN_START, range(world), None, {
            "trainguard": __version__, "config_hash": config_hash(self.cfg),
            "world": world, "coords": [c.as_dict() for c in coords],
            "faults": [f.model_dump() for f in self.cfg.faults], "probes": probes.describe(),
            "agree": {"way": agreement.way, "bytes_per_step": agreement.bytes_per_step,
                      "rows_every_step": rows_every_step}, **framework})

    def decided(self, step: int, view, decision: Decision, verdicts: list, everyone: dict | None,
                skipped_steps: int, weights: dict | None) -> None:
        """What DECIDE found, written: the faults that fired, the samples set aside, each verdict with the decision."""
        if view.summary.faults_fired:
            self.faults(step, list(view))
        if everyone:
            self.rejections(step, everyone)
        for v in verdicts:
            self.verdict(step, v, decision, everyone, skipped_steps, weights)

    def custom_alerts(self, step: int, found: list) -> None:
        """Your detectors' verdicts: alerts (the ladders act on the built-in classes only)."""
        for v in found:
            self.alert(step, Record.CUSTOM_ALERT, v.ranks, {"detector": v.detector, "anomaly": v.anomaly, **v.detail})

    def framework_skip(self, step: int) -> None:
        self.emit(step, Record.FRAMEWORK_SKIP, [], None, {"reason": "the framework skipped this step itself (e.g. fp16 "
                                                          "loss-scale overflow found after the reduction)"})

    def abort(self, step: int, decision: Decision, everyone: dict, skipped_steps: int, policy) -> TrainguardAbort:
        """The report every rank raises with when the decision is ABORT (written)."""
        report = records.abort_report(step, decision, everyone, self.coords_of, skipped_steps, policy)
        self.emit(step, Record.ABORT, sorted({r for v in decision.verdicts for r in v.ranks}), Action.ABORT.value,
                  report)
        return TrainguardAbort(f"trainguard aborted the run at step {step}: {decision.reason}", report)

    def run_end(self, step: int, world: int, totals: dict) -> None:
        """The last open incidents, the run_end record; then the files closed."""
        self.close_incidents(step, at_end=True)
        self.emit(step, Record.RUN_END, range(world), None, totals)
        self.events.close()

    def alert(self, step: int, record: Record, ranks, detail: dict, **extra) -> None:
        """An alert (no ladder acts on it): written when it opens an incident, else folded into the open one."""
        if self.incidents is not None:
            incident = self.incidents.admit(step, record.value, ranks, detail)
            if incident is None:
                return
            detail = {**detail, "incident": incident}
        self.emit(step, record, ranks, ALERT, detail, rank_local=self.rank in ranks, **extra)

    def close_incidents(self, step: int, at_end: bool = False, why: str | None = None) -> None:
        for inc in self.incidents.expire(step, at_end, why) if self.incidents is not None else ():
            self.emit(step, Record.INCIDENT_CLOSED, inc["ranks"], None, inc)

    def faults(self, step: int, rows) -> None:
        """The ranks whose injected faults fired (their rows)."""
        rec = records.faults_fired(step, rows, self.cfg.faults)
        if rec is not None:
            self.emit(step, *rec, rank_local=self.rank in rec[1])

    def rejections(self, step: int, everyone: dict[int, dict]) -> None:
        rec = records.rejections(everyone, self.coords_of, self.cfg.sanitize.action)
        if rec is not None:
            self.emit(step, *rec, rank_local=self.rank in rec[1])

    def verdict(self, step: int, v: Verdict, decision: Decision, everyone: dict[int, dict] | None,
                skipped_steps: int, weights: dict | None) -> None:
        record, ranks, action, detail, extra = records.verdict(v, decision, everyone, self.coords_of, skipped_steps,
                                                                weights, self.no_ids)
        if action == ALERT and anomaly_class(v) is None:  # (a ladder class's verdict is written every time)
            self.alert(step, record, ranks, detail, **extra)
        else:
            self.emit(step, record, ranks, action, detail, rank_local=self.rank in ranks, **extra)

    def stragglers(self, step: int, found: list[Verdict]) -> None:
        """Alerts only: a slow rank is named, the ladders do not act on it."""
        for v in found:
            (r,) = v.ranks
            coords = self.coords_of(r)
            self.alert(step, Record.STRAGGLER, [r], {"coords": coords, "host": coords.get("host"), **v.detail})
