"""The records a step's verdicts turn into: who, where, which samples, what was done (pure:
each function returns ``(record, ranks, action, detail[, extra])`` for EventLog.emit)."""
from __future__ import annotations

from typing import Callable, Sequence

from trainguard.verdicts import RankObservation, Verdict
from trainguard.events import Action, Record

ALERT = "alert"
NO_SAMPLE_IDS = "unknown: the loader reported no sample ids"  # (and the adapter's advice: its HINTS["sample_ids"])


def faults_fired(step: int, obs: Sequence[RankObservation], faults) -> tuple | None:
    fired_ranks = [o.rank for o in obs if o.faults_fired]
    if not fired_ranks:
        return None
    specs = [f.model_dump() for f in faults if f.active(step) and (f.rank in fired_ranks or f.type == "lr_ramp")]
    return Record.FAULT_INJECTED, fired_ranks, None, {"faults": specs}


def rejections(everyone: dict[int, dict], coords_of: Callable[[int], dict], action: str) -> tuple | None:
    per_rank = {str(r): {"rejected": [{"sample_id": i, "problems": p} for i, p in e["rejected"]],
                         "coords": coords_of(r)}
                for r, e in sorted(everyone.items()) if e["rejected"]}
    if not per_rank:
        return None
    return Record.SAMPLES_REJECTED, sorted(int(r) for r in per_rank), action, {"per_rank": per_rank}


def verdict(v: Verdict, decision, everyone: dict[int, dict] | None, coords_of: Callable[[int], dict],
            skipped_steps: int, weights: dict | None = None, no_ids: str = NO_SAMPLE_IDS) -> tuple:
    """Name the culprits with their coordinates, host, samples and (non-finite) first bad module.
    ``weights``: the step's replay of a healthy micro-batch (trainguard.replay.replay), for the classes it
    decides. A rank whose samples were narrowed by a per-sample replay names those samples
    (``sample_ids``) beside its whole batch (``batch_sample_ids``). ``no_ids``: the note where no rank's loader
    named its samples (the adapter's advice)."""
    from trainguard.decisions import DATA_OR_WEIGHTS, anomaly_class

    detail = {"detector": v.detector, **v.detail}
    per_rank = {}
    for r in v.ranks:
        raw = v.detail.get("per_rank", {}).get(r, {}) if isinstance(v.detail.get("per_rank"), dict) else {}
        d = {"values": raw} if isinstance(raw, list) else dict(raw)
        d["coords"] = coords_of(r)
        e = (everyone or {}).get(r)
        if e is not None:
            d.update({"sample_ids": e["sample_ids"], "position": e["position"]})
            if e.get("narrowed") and anomaly_class(v) in DATA_OR_WEIGHTS:
                d.update({"sample_ids": e["narrowed"]["ids"], "batch_sample_ids": e["sample_ids"],
                          "narrowed": {"by": "per-sample replay", "rows": e["narrowed"]["rows"],
                                       "losses": e["narrowed"]["losses"]}})
            if e.get("localized") is not None and v.anomaly == "nonfinite":
                # the replay checks every module: it outranks a sampled probe's partial view
                if e["localized"].get("module") or "first_nonfinite_module" not in d:
                    d["first_nonfinite_module"] = e["localized"].get("module")
                d["localized"] = e["localized"]
        per_rank[str(r)] = d
    if per_rank:
        detail["per_rank"] = per_rank
    if weights is not None and anomaly_class(v) in DATA_OR_WEIGHTS:
        detail["weights"] = weights  # {"verdict": healthy | damaged | None, "replayed_losses": per rank}
    is_nonfinite = v.anomaly == "nonfinite"
    acting = anomaly_class(v) is not None and anomaly_class(v) in (decision.anomaly, "nonfinite")
    action = decision.action.value if acting and decision.action is not Action.CONTINUE else ALERT
    extra = {}
    if is_nonfinite:
        detail["reason"] = decision.reason
        if everyone and not any(e["sample_ids"] for e in everyone.values()):
            detail["sample_ids_note"] = no_ids
        extra["skipped_steps"] = skipped_steps + (decision.action in (Action.SKIP_STEP, Action.ROLLBACK))
    return Record(v.anomaly), list(v.ranks), action, detail, extra


def abort_report(step: int, decision, everyone: dict[int, dict], coords_of: Callable[[int], dict], skipped_steps: int,
                 policy) -> dict:
    """The report every rank raises with (TrainguardAbort) and the log keeps."""
    culprits = sorted({r for v in decision.verdicts for r in v.ranks})
    return {"step": step, "reason": decision.reason,
            "verdicts": [{"detector": v.detector, "anomaly": v.anomaly, "ranks": list(v.ranks),
                          "detail": v.detail} for v in decision.verdicts],
            "coords": {str(r): coords_of(r) for r in culprits},
            "samples": {str(r): {k: everyone.get(r, {}).get(k)
                                 for k in ("sample_ids", "position")} for r in culprits},
            "tried": {"skipped_steps": skipped_steps, "rollbacks": policy.tried, "lr_factor": policy.lr_factor,
                      "consecutive_nonfinite": policy.consecutive_nonfinite,
                      "total_nonfinite": policy.total_nonfinite}}
