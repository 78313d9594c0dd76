"""Launch the demo worker under torchrun and summarise what happened (used by the CLI and tests)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Sequence

from trainguard.demo.processes import (  # noqa: F401 - (this module's names before: the tests and benches use them)
    fresh, kill_tree, leave, reap, run_bounded, run_worker, torchrun_env, worker_pids,
)
from trainguard.metrics.jsonl import read

DEFAULT_CONFIG = Path(__file__).with_name("demo.json")


VERDICT_PRIORITY = ["nonfinite", "instant_burst", "slow_rise", "suspect_rank", "entropy_collapse", "samples_rejected",
                    "activation_range", "grad_surge", "entropy_saturation", "framework_skip"]


def fault_table(events: list[dict]) -> list[dict]:
    """One row per (step, rank) with an injected fault or a verdict: step, rank, fault, verdict,
    action, and what names the culprit (first non-finite module, attention layer/head, samples)."""
    rows: dict[tuple[int, int], dict] = {}
    late_faults: dict[tuple[int, int], str] = {}

    def row(step, rank):
        return rows.setdefault((step, rank), {"step": step, "rank": rank, "_prio": len(VERDICT_PRIORITY)})

    for e in events:
        if e.get("type") != "event":
            continue
        name = e["event"]
        if name == "fault_injected":
            for f in e["detail"].get("faults", []):
                if e["step"] == f["step"]:  # a fault lasting several steps: one row, at its start
                    row(e["step"], f["rank"])["fault"] = f["type"]
                else:
                    late_faults[(e["step"], f["rank"])] = f["type"]
            continue
        if name not in VERDICT_PRIORITY:
            continue
        prio = VERDICT_PRIORITY.index(name)
        for r in e["ranks"] or [-1]:
            cur = row(e["step"], r)
            if prio >= cur["_prio"]:
                continue
            d = e["detail"].get("per_rank", {}).get(str(r), {})
            label = name
            if name == "nonfinite":
                label = f"nonfinite ({d.get('origin', '?')})"
            where = d.get("first_nonfinite_module") or ""
            if name == "entropy_collapse":
                heads = [h for h in e["detail"].get("heads", []) if h["rank"] == r]
                where = ", ".join(f"{h['layer']} head {h['head']}" for h in heads[:2])
            if name == "samples_rejected":
                where = "; ".join(f"sample {x['sample_id']}: {x['problems'][0]}" for x in d.get("rejected", [])[:1])
            cur.update({"verdict": label, "action": e["action"] or "-", "where": where, "_prio": prio,
                        "samples": d.get("sample_ids", [])})
    unavailable = {e["step"] for e in events if e.get("event") == "rollback_unavailable"}
    out = [rows[k] for k in sorted(rows)]
    for r in out:
        r.pop("_prio", None)
        if r.get("action") == "rollback" and r["step"] in unavailable:
            r["action"] = "skip_step"  # the ladder said roll back, but no checkpoint predated the onset
        if "fault" not in r and (r["step"], r["rank"]) in late_faults:
            r["fault"] = f"({late_faults[(r['step'], r['rank'])]})"
    return out


def format_rows(rows: list[dict]) -> str:
    head = f"{'step':>5}  {'rank':>4}  {'fault':<18} {'verdict':<22} {'action':<12} where / samples"
    lines = [head, "-" * (len(head) + 20)]
    for r in rows:
        samples = r.get("samples") or []
        shown = r.get("where") or (",".join(map(str, samples[:4])) + (",..." if len(samples) > 4 else ""))
        lines.append(f"{r['step']:>5}  {r['rank'] if r['rank'] >= 0 else '-':>4}  {r.get('fault', '-'):<18} "
                     f"{r.get('verdict', 'none'):<22} {r.get('action', '-'):<12} {shown}")
    return "\n".join(lines)


def summarise(results: list[dict | None]) -> dict:
    ok = [r for r in results if r]
    if not ok:
        return {"completed": False}
    died = next((r["died"] for r in ok if r.get("died")), None)
    if died is not None:  # (a run that stopped -- plain DeepSpeed at its minimum loss scale: what the demo is for)
        return {"completed": False, "steps": ok[0].get("global_steps"), "died": died}
    return {
        "completed": len(ok) == len(results) and not any(r["aborted"] for r in ok),
        "steps": ok[0]["global_steps"],
        "skipped": sorted({r["skipped_steps"] for r in ok}),
        "weights_finite": all(r["weights_finite"] for r in ok),
        "eval_loss": ok[0]["eval_loss"],
        "same_weights_on_all_ranks": len({r["param_sha256"] for r in ok}) == 1,
    }


def demo(config: str | os.PathLike | None, steps: int, out: str | os.PathLike, extra: Sequence[str] = (),
         stream=sys.stdout, natural: bool = True, figures: dict | None = None) -> int:
    """``figures``: filled with what the tables print (bench/demo.py keeps it)."""
    config = Path(config) if config else DEFAULT_CONFIG
    out = Path(out)
    print(f"trainguard demo: 2 ranks, {steps} steps, config {config}", file=stream)
    fresh(out / "trainguard", out / "plain")  # (each run from its start: a run resumes from what it finds)
    print("  run 1/2: under trainguard (ds_plugins.initialize) ...", file=stream, flush=True)
    rc_g, res_g = run_worker(config, out / "trainguard", steps, extra=extra)
    print("  run 2/2: plain DeepSpeed (deepspeed.initialize), same seeds, data and faults ...",
          file=stream, flush=True)
    rc_p, res_p = run_worker(config, out / "plain", steps, extra=[*extra, "--plain"])
    if rc_g != 0:
        print(f"the guarded run failed (exit {rc_g}); see {out / 'trainguard' / 'torchrun.log'}", file=stream)
        return 1
    events = read(out / "trainguard" / "trainguard.jsonl")
    print("", file=stream)
    print(format_rows(fault_table(events)), file=stream)
    g, p = summarise(res_g), summarise(res_p)
    if rc_p != 0:
        p["completed"] = False

    def fmt(x):
        return "NaN" if x is None else f"{x:.4f}" if isinstance(x, float) else str(x)

    print("", file=stream)
    print(f"{'':<26}{'trainguard':<22}{'plain DeepSpeed':<22}", file=stream)
    for label, key in [("completed", "completed"), ("optimizer steps", "steps"),
                       ("skipped steps (per rank)", "skipped"), ("weights finite", "weights_finite"),
                       ("held-out loss (final)", "eval_loss")]:
        print(f"{label:<26}{fmt(g.get(key)):<22}{fmt(p.get(key)):<22}", file=stream)
    print(f"{'culprit rank and samples':<26}{'named in the log':<22}{'not reported':<22}", file=stream)
    if p.get("died"):
        print(f"\nplain DeepSpeed stopped at step {p.get('steps')}: {p['died']}", file=stream)
    if any(r.get("fault") == "bad_label" for r in fault_table(events)):
        print("\nbad_label is a loader fault: DeepSpeed's own loader has no injection point, so the plain run "
              "did not get it.\nUnsanitised, an out-of-range label crashes cross-entropy (tests/dist/"
              "test_detect_dist.py).", file=stream)
    print("", file=stream)
    print(f"event log: {out / 'trainguard' / 'trainguard.jsonl'}", file=stream)
    if figures is not None:
        figures.update(faults=fault_table(events), trainguard=g, plain=p)
    if natural:
        found = natural_case(config, out / "natural", extra=extra, stream=stream)
        if figures is not None:
            figures["natural"] = {k: found[k] for k in ("trainguard", "plain", "did")}
    return 0


# beside the injected faults: a failure nobody injected (bench/natural runs the whole corpus)
NATURAL = {"what": "the peak LR raised 15x at step 150, as in a run resumed with a raised schedule",
           "args": ["--raise-lr", "150:15"], "steps": 300}


def natural_case(config: Path, out: Path, extra: Sequence[str] = (), stream=sys.stdout) -> dict:
    """The demo's natural row: the same model and block, no fault configured, an LR schedule raised mid-run, under
    trainguard and plain. A plain run that dies is a row of the table (how it died), never a traceback."""
    from trainguard.config import read_json

    out.mkdir(parents=True, exist_ok=True)
    cfg = read_json(config)
    block = cfg.get("trainguard", {})
    block.pop("faults", None)
    block.pop("allow_faults", None)
    path = out / "ds_config.json"
    path.write_text(json.dumps(cfg, indent=1))
    print(f"\nA natural failure, nothing injected: {NATURAL['what']} ({NATURAL['steps']} steps).", file=stream)
    fresh(out / "trainguard", out / "plain")
    print("  run 1/2: under trainguard ...", file=stream, flush=True)
    rc_g, res_g = run_worker(path, out / "trainguard", NATURAL["steps"], extra=[*extra, *NATURAL["args"]])
    print("  run 2/2: plain DeepSpeed ...", file=stream, flush=True)
    rc_p, res_p = run_worker(path, out / "plain", NATURAL["steps"], extra=[*extra, *NATURAL["args"], "--plain"])
    g, p = summarise(res_g), summarise(res_p)
    log = out / "trainguard" / "trainguard.jsonl"
    events = [e for e in read(log) if e.get("type") == "event"] if log.exists() else []
    for r, rc, results, evs in ((g, rc_g, res_g, events), (p, rc_p, res_p, [])):
        if rc != 0 or not r.get("completed"):
            r["completed"] = False
            r["why"] = stopped_why(results, rc, evs)
    acts = [_did(e) for e in events if e["event"] in ("rollback", "rollback_unavailable", "precision_fallback")]
    skipped = sum(1 for e in events if e.get("action") == "skip_step" and e["event"] != "rollback_unavailable")
    did = "; ".join(acts[:4] + ([f"{skipped} step(s) skipped"] if skipped else [])) or "nothing"

    def fmt(r):
        if r.get("died"):
            return f"died at step {r.get('steps')}"
        return "NaN" if r.get("eval_loss") is None else f"{r['eval_loss']:.4f}"

    print("", file=stream)
    print(f"{'':<26}{'trainguard':<22}{'plain DeepSpeed':<22}", file=stream)
    print(f"{'completed':<26}{str(g.get('completed')):<22}{str(p.get('completed')):<22}", file=stream)
    print(f"{'held-out loss (final)':<26}{fmt(g):<22}{fmt(p):<22}", file=stream)
    print(f"what trainguard did: {did}", file=stream)
    for name, r in (("trainguard", g), ("plain DeepSpeed", p)):
        if not r.get("completed"):
            print(f"{name} stopped at step {r.get('steps')}: {r['why']}", file=stream)
    return {"trainguard": g, "plain": p, "did": did, "events": events}


def stopped_why(results: list[dict | None], rc: int, events: list[dict]) -> str:
    """Why a run did not complete, in a line: the framework's error, trainguard's abort (its reason), a rank that wrote
    no result, or the launch's exit code."""
    ok = [r for r in results if r]
    died = next((r["died"] for r in ok if r.get("died")), None)
    if died:
        return str(died)
    aborted = next((e["detail"].get("reason") for e in events if e.get("event") == "abort"), None) or \
        next(((r["aborted"] or {}).get("message") for r in ok if r.get("aborted")), None)
    if aborted:
        return f"trainguard stopped it: {aborted}"
    if len(ok) < len(results):
        return f"{len(results) - len(ok)} rank(s) wrote no result (killed?); the launch exited {rc}"
    return f"the launch exited {rc}"


def _did(e: dict) -> str:
    d = e.get("detail") or {}
    lr = f", LR x{d['lr_factor']:.3g}" if d.get("lr_factor") else ""
    if e["event"] == "rollback":
        return f"step {e['step']}: {d.get('anomaly')} -> rolled back to step {d.get('to_step')}{lr}"
    if e["event"] == "rollback_unavailable":
        return f"step {e['step']}: {d.get('anomaly')} -> no checkpoint before the onset: skipped{lr}"
    if e["event"] == "precision_fallback":
        return f"step {e['step']}: continued in bf16"
    return f"step {e['step']}: {e['event']}"
