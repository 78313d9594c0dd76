"""Alerts as incidents: a condition that persists is one incident, not a record per check per rank.

An attention head collapsed for the rest of a run wrote ``entropy_collapse`` every sampled step on both ranks
(14 records in 60 steps); an on-call person paged by it would mute it. Now the first alert of a kind
*opens* an incident -- its record is written, with ``incident: {"id", "state": "opened"}`` -- and the alerts of
that kind that follow within ``gap`` steps are folded into it (counted, their worst value kept, their ranks
merged; no record). When ``gap`` steps pass without one, the incident *closes*: one ``incident_closed`` record
with the count, the first and last step and the worst value. An incident still open at the end of the run is
closed there (``open_at_end``).

Pure and the same on every rank (the verdicts that feed it are); only the kinds no ladder acts on pass through
it (``grad_surge``, ``entropy_*``, ``activation_range``, ``straggler``, ``custom_alert``) -- a verdict of a ladder
class is written every time, even as an alert (recovery off).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

# the worst value of an alert of each kind, and which way is worse
WORST: dict[str, tuple[str, Callable[[dict], float | None], Callable]] = {
    "grad_surge": ("z", lambda d: d.get("z"), max),
    "entropy_collapse": ("entropy_ratio", lambda d: min((h["ratio"] for h in d.get("heads", [])), default=None), min),
    "entropy_saturation": ("entropy_ratio", lambda d: max((h["ratio"] for h in d.get("heads", [])), default=None),
                           max),
    "activation_range": ("max_abs", lambda d: max((m["max_abs"] for r in (d.get("per_rank") or {}).values()
                                                   for m in (r.get("values", []) if isinstance(r, dict) else r)),
                                                  default=None), max),
    "straggler": ("slower_by", lambda d: d.get("slower_by"), max),
}


@dataclass
class Incident:
    id: int
    record: str
    first_step: int
    last_step: int
    count: int = 1
    ranks: set = field(default_factory=set)
    worst: float | None = None

    def summary(self) -> dict:
        key = WORST.get(self.record, ("value",))[0]
        return {"id": self.id, "record": self.record, "first_step": self.first_step, "last_step": self.last_step,
                "count": self.count, "ranks": sorted(self.ranks), "worst": {key: self.worst}}


class Incidents:
    def __init__(self, gap: int):
        self.gap = gap
        self.open: dict[str, Incident] = {}
        self.next_id = 1

    def admit(self, step: int, record: str, ranks, detail: dict) -> dict | None:
        """An alert of kind ``record``: the ``incident`` field for its record when it opens one (write it), None
        when it is folded into the open one (write nothing)."""
        value = _worst(record, detail)
        inc = self.open.get(record)
        if inc is not None and step - inc.last_step <= self.gap:
            inc.count += 1
            inc.last_step = max(inc.last_step, step)
            inc.ranks.update(ranks)
            if value is not None:
                pick = WORST[record][2]
                inc.worst = value if inc.worst is None else pick(inc.worst, value)
            return None
        inc = Incident(self.next_id, record, step, step, ranks=set(ranks), worst=value)
        self.next_id += 1
        self.open[record] = inc
        return {"id": inc.id, "state": "opened", "closes_after": self.gap}

    def expire(self, step: int, at_end: bool = False, why: str | None = None) -> list[dict]:
        """The incidents that closed by ``step`` (no alert of their kind for ``gap`` steps), or all at the end of
        the run (``at_end``) or at a rollback (``why``: the step counter goes back, and a gap measured across it
        would fold the re-run's alerts into the abandoned trajectory's)."""
        done = [k for k, inc in self.open.items() if at_end or why or step - inc.last_step > self.gap]
        extra = {"open_at_end": True} if at_end else {"closed_by": why} if why else {}
        return [{**self.open.pop(k).summary(), **extra} for k in sorted(done)]


def _worst(record: str, detail: dict) -> float | None:
    spec = WORST.get(record)
    if spec is None:
        return None
    try:
        v = spec[1](detail)
    except (TypeError, KeyError, ValueError):
        return None
    return float(v) if isinstance(v, (int, float)) else None
