"""The first thing read after a page: a short text summary of a trainguard JSONL log.

``trainguard report`` prints it above the plots it writes (and keeps it as ``summary.txt``):
incidents by class with their steps, ranks and samples; what was done about them (skips,
rollbacks, restarts, precision fallbacks); steps lost and goodput; and the open questions a person
should look at next (docs/playbooks.md says what to do for each).
"""
from __future__ import annotations

from collections import defaultdict

# events that are incidents (something went wrong), in the order a person should read them
INCIDENTS = ("abort", "hang_detected", "nonfinite", "overflow", "loss_scale", "instant_burst", "slow_rise",
             "grad_surge", "entropy_collapse", "entropy_saturation", "activation_range", "samples_rejected",
             "suspect_rank", "checkpoint_invalid", "checkpoint_failed", "resume_discontinuity", "straggler")
# what trainguard did
REMEDIES = ("rollback", "rollback_unavailable", "loss_scale_reset", "precision_fallback", "rank_replaced", "restart",
            "resume")
LR_CLASSES = {"slow_rise"}  # (an LR problem: the samples of its steps are not its cause, so none are listed)


def _samples(e: dict) -> set:
    d = e.get("detail") or {}
    out = set()
    for info in (d.get("per_rank") or {}).values():
        if isinstance(info, dict):
            out |= {i for i in info.get("sample_ids") or [] if isinstance(i, int)}
    for ids in (d.get("quarantined") or {}).values():
        out |= {i for i in ids if isinstance(i, int)}
    return out | {i for i, _ in _rejected(e)}


def _rejected(e: dict) -> list[tuple[int, str]]:
    """The samples a ``samples_rejected`` record names, each with why (its problems)."""
    out = []
    for info in ((e.get("detail") or {}).get("per_rank") or {}).values():
        for r in (info.get("rejected") or []) if isinstance(info, dict) else []:
            if isinstance(r, dict) and isinstance(r.get("sample_id"), int):
                why = r.get("problems")
                out.append((r["sample_id"], "; ".join(map(str, why)) if isinstance(why, list) else str(why or "?")))
    return out


def _done(kind: str, es: list[dict]) -> str:
    """One line of what was done: a rollback with its target and LR, a replaced rank with why and where it went on."""
    if kind == "rollback":
        what = ", ".join(f"{e['step']}->{(e.get('detail') or {}).get('to_step')}" + (
            f" LR x{d['lr_factor']:g}" if isinstance((d := e.get("detail") or {}).get("lr_factor"), (int, float))
            else "") for e in es)
        return f"  rollback             x{len(es):<3} ({what})"
    if kind == "rank_replaced":
        what = "; ".join(f"rank {d.get('rank')} died ({str(d.get('why') or '?')[:60]}), a spare took its place, "
                         f"resumed at step {d.get('resumed_at_step', e['step'])}" for e in es
                         for d in [e.get("detail") or {}])
        return f"  rank_replaced        x{len(es):<3} ({what})"
    return f"  {kind:<20} x{len(es):<3} at steps {sorted({e['step'] for e in es})}"


def _ranks(e: dict) -> set:
    ranks = set(e.get("ranks") or [])
    for c in (e.get("detail") or {}).get("culprits") or []:
        if isinstance(c, dict) and isinstance(c.get("rank"), int):
            ranks.add(c["rank"])
    return ranks


def _folded(es: list[dict], closes: list[dict], kind: str) -> tuple[int, int, int] | None:
    """Alerts of ``kind`` counted with the ones folded into their incidents (trainguard.observe.incidents): (alerts,
    incidents, last step), or None when none of its records opened an incident."""
    opened = [e for e in es if isinstance((e.get("detail") or {}).get("incident"), dict)]
    if not opened:
        return None
    mine = [c["detail"] for c in closes if (c.get("detail") or {}).get("record") == kind]
    closed_ids = {c.get("id") for c in mine}
    still_open = [e for e in opened if e["detail"]["incident"].get("id") not in closed_ids]  # (a killed run)
    count = len(es) - len(opened) + sum(c.get("count", 1) for c in mine) + len(still_open)
    last = max([c.get("last_step", 0) for c in mine] + [e["step"] for e in es])
    return count, len(opened), last


def summarize(lines: list[dict]) -> str:
    events = [x for x in lines if x.get("type") == "event"]
    metrics = [x for x in lines if x.get("type") == "metric"]
    by: dict[str, list[dict]] = defaultdict(list)
    for e in events:
        by[e["event"]].append(e)
    last_step = max([x.get("step", 0) for x in lines if isinstance(x.get("step"), int)] or [0])
    ends = by.get("run_end") or []
    good = ((ends[-1].get("detail") or {}).get("goodput") if ends else None) or {}
    if not good and metrics:
        good = {"goodput": metrics[-1].get("goodput")}
    out = []
    verdict = "ABORTED" if by.get("abort") else "finished" if ends else "no run_end record (still running, or killed)"
    # (a launch whose loop raised -- a peer died, the job was stopped -- says so: it was no end of the run; a launch
    # begun after the last run_end is the run now, still running or killed)
    stopped = [(e["step"], e["detail"]["interrupted"]) for e in ends if (e.get("detail") or {}).get("interrupted")]
    last_start = max((i for i, e in enumerate(events) if e["event"] == "run_start"), default=-1)
    if ends and last_start > max(i for i, e in enumerate(events) if e["event"] == "run_end"):
        verdict = "no run_end record for the last launch (still running, or killed)"
    elif stopped and not by.get("abort") and (ends[-1].get("detail") or {}).get("interrupted"):
        verdict, stopped = f"STOPPED by an error at step {stopped[-1][0]} ({stopped[-1][1]})", stopped[:-1]
    if stopped:
        verdict += f" (after {len(stopped)} launch(es) stopped by an error, the first at step {stopped[0][0]}: " \
                   f"{stopped[0][1]})"
    out.append(f"trainguard summary: {verdict}; last step {last_step}; "
               + (f"goodput {good['goodput']:.3f}" if isinstance(good.get("goodput"), (int, float)) else "goodput -")
               + (f", steps lost {good['steps_lost']}" if good.get("steps_lost") is not None else "")
               + (f", skipped {good['skipped_steps']}" if good.get("skipped_steps") is not None else ""))
    incidents = [(k, by[k]) for k in INCIDENTS if by.get(k)]
    if not incidents:
        out.append("incidents: none")
    else:
        out.append("incidents:")
        for kind, es in incidents:
            steps = sorted({e["step"] for e in es})
            ranks = sorted(set().union(*(_ranks(e) for e in es)))
            samples = [] if kind in LR_CLASSES else sorted(set().union(*(_samples(e) for e in es)))
            count, grouped = len(es), _folded(es, by.get("incident_closed") or [], kind)
            if grouped:  # (alerts as incidents: what the closes say was folded in)
                count, opened, last = grouped
                steps = sorted(set(steps) | {last})
                ranks = sorted(set(ranks) | set().union(*(set(c["detail"].get("ranks") or []) for c in
                                                          by["incident_closed"] if c["detail"].get("record") == kind)))
            span = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}..{steps[-1]}"
            line = f"  {kind:<20} x{count:<3} {span}" + (f" ({opened} incident{'s' * (opened > 1)})" if grouped else "")
            if ranks:
                line += f"; ranks {ranks}"
            if samples:
                line += f"; samples {samples[:8]}{' ...' if len(samples) > 8 else ''} ({len(samples)})"
            actions = sorted({e.get("action") for e in es if e.get("action")})
            if actions:
                line += f"; action {', '.join(actions)}"
            out.append(line)
    done = [(k, by[k]) for k in REMEDIES if by.get(k)]
    skips = sorted({e["step"] for e in events if e.get("action") == "skip_step" and e["event"] != "overflow"})
    if done or skips:
        out.append("done about it:")
        if skips:
            overflows = " (an fp16 scaler's own skips: overflow, above)" if by.get("overflow") else ""
            out.append(f"  skip_step            x{len(skips):<3} at steps {skips[:12]}{' ...' if len(skips) > 12 else ''}"
                       f" (the step's update left out, the run went on){overflows}")
        out += [_done(kind, es) for kind, es in done]
    rejected = [(i, why, e["step"]) for e in by.get("samples_rejected") or [] for i, why in _rejected(e)]
    if rejected:
        out.append("samples rejected (id, step: why):")
        out += [f"  {i}, step {step}: {why[:100]}" for i, why, step in rejected[:10]]
        out += [f"  ... and {len(rejected) - 10} more (the samples_rejected records)"] if len(rejected) > 10 else []
    if by.get("abort"):
        reason = (by["abort"][-1].get("detail") or {}).get("reason")
        out.append(f"abort reason: {reason}")
    return "\n".join(out)
