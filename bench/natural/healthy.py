"""Healthy runs, long, under trainguard's defaults: what it must leave alone (issue 51).

    python bench/natural/healthy.py [--steps 1500] [--runs NAME,...] [--out DIR] [--json FILE]

Each run is a sane setting a user would choose -- none of them shaped by a failure -- under the README's block with
every default detector and ladder, for ``--steps`` steps (default 1,500): DeepSpeed's own loop (the demo's model,
bf16; fp16 with its dynamic loss scale; a higher LR that trains well), HF's Trainer (the same model, zero-code), and
Megatron-LM's unmodified pretrain_gpt.py (TP=2, mock data) at ``--lr 0.01`` after 100 warmup iterations -- the run
that trained down to a loss near 0 and was restarted from step 1 for a wiggle. Goals, each run: no action
(skip_step, rollback, rollback_lower_lr, bf16_fallback, abort), at most one alert incident per 1,000 steps, the run
finished. Prints one line per run and exits 1 when a goal is missed; ``--json`` keeps the figures
(bench/_results.keep: date, commit, clean).
"""
from __future__ import annotations

import argparse
import copy
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.natural.run import BLOCK, Case, acted_on, incidents, summarise_run  # noqa: E402
from trainguard.demo.run import run_worker  # noqa: E402

RUNS = {
    "ds_bf16": Case("ds_bf16", "deepspeed", "DeepSpeed ZeRO-2 bf16, LR 0.003 after 100 warmup steps", {"lr": 0.003}),
    "ds_fp16": Case("ds_fp16", "deepspeed", "DeepSpeed ZeRO-2 fp16 (dynamic loss scale), LR 0.003",
                    {"lr": 0.003, "fp16": True}),
    "ds_lr01": Case("ds_lr01", "deepspeed", "DeepSpeed ZeRO-2 bf16, LR 0.01 after 300 warmup steps",
                    {"lr": 0.01, "warmup": 300}),
    "hf": Case("hf", "hf", "HF Trainer (zero-code), learning_rate 0.003, warmup_steps 100", {"lr": 0.003}),
    "mg_near_zero": Case("mg_near_zero", "megatron", "Megatron-LM pretrain_gpt.py TP=2, --lr 0.01, 100 warmup "
                         "iterations (trains down to a loss near 0)", {"lr": 0.01, "warmup": 100}),
}


def _last(losses):
    if not losses:
        return None
    x = losses[-1]
    return x[-1] if isinstance(x, (list, tuple)) else x


def run_one(case: Case, out: Path) -> dict:
    d = out / case.name
    shutil.rmtree(d, ignore_errors=True)  # (fresh: a run's progress and JSONL are appended to)
    d.mkdir(parents=True)
    t0 = time.time()
    if case.stack == "megatron":
        from bench.natural import megatron_lm

        summary = megatron_lm.run(case.bad, "guarded", d, case.steps, copy.deepcopy(BLOCK))
    else:
        cfg = case.config("guarded", d)  # (the case's setting is the healthy one: "guarded" reads it as given)
        (d / "ds_config.json").write_text(json.dumps(cfg, indent=1))
        rc, results = run_worker(d / "ds_config.json", d, case.steps, extra=case.args("guarded"), timeout=3600,
                                 **case.launch("guarded"))
        summary = summarise_run(d, rc, results, time.time() - t0)
    acted = [{"step": e["step"], "event": e["event"], "action": e.get("action")} for e in acted_on(summary["events"])]
    steps = summary["steps"] or 0
    per_1k = round(1000 * incidents(summary["events"]) / max(steps, 1), 2)
    finished = not summary["died"] and not summary["aborted"] and steps >= case.steps
    return {"run": case.name, "stack": case.stack, "what": case.what, "steps": steps, "finished": finished,
            "actions": acted, "alert_incidents_per_1k": per_1k, "seconds": summary["seconds"],
            "final_loss": _last(summary["losses"]),
            "ok": finished and not acted and per_1k <= 1.0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--runs", help="comma-separated run names (default: all): " + ", ".join(RUNS))
    ap.add_argument("--out", default="/tmp/trainguard-healthy")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    names = args.runs.split(",") if args.runs else list(RUNS)
    rows = []
    for name in names:
        case = copy.deepcopy(RUNS[name])
        case.steps = args.steps
        row = run_one(case, Path(args.out))
        rows.append(row)
        print(f"{row['run']:<14} {row['steps']:>5} steps  finished {row['finished']!s:<5}  actions "
              f"{len(row['actions'])}  alert incidents/1k {row['alert_incidents_per_1k']:<5}  "
              f"{'ok' if row['ok'] else 'MISSED'}  ({row['seconds']} s) {row['actions'][:3]}", flush=True)
    missed = [r["run"] for r in rows if not r["ok"]]
    print(f"healthy: {len(rows) - len(missed)}/{len(rows)} runs took no action and raised <= 1 alert incident per "
          f"1,000 steps" + (f"; missed: {', '.join(missed)}" if missed else ""))
    if args.json:
        from bench._results import keep

        keep(args.json, {"steps": args.steps, "rows": rows, "missed": missed})
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
