"""How the guard writes what a step found: one record each (trainguard.records shapes them, EventLog writes them),
an alert folded into its open incident (trainguard.incidents), the step's faults, set-aside samples, verdicts and
stragglers."""
from __future__ import annotations

from typing import Callable

from trainguard import records
from trainguard.eventlog import EventLog
from trainguard.events import Record
from trainguard.incidents import Incidents
from trainguard.policy import Decision, anomaly_class
from trainguard.verdicts import Verdict

ALERT = records.ALERT


class StepLog:
    def __init__(self, rank: int, cfg, coords_of: Callable[[int], dict]):
        self.rank, self.cfg, self.coords_of = rank, cfg, coords_of
        self.events = EventLog(rank)
        self.incidents = Incidents(cfg.metrics.incident_gap) if cfg.metrics.incident_gap else None

    def emit(self, step: int, record: Record, ranks=(), action: str | None = None, detail: dict | None = None,
             rank_local: bool = False, **extra) -> None:
        """Write one record (trainguard.eventlog.EventLog.emit): the one way anything is logged."""
        self.events.emit(step, record, ranks, action, detail, rank_local=rank_local, **extra)

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
                                                                weights)
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
