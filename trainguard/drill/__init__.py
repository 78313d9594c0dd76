"""The fire drill: the demo model under a schedule of real-world faults, with trainguard and with
plain DeepSpeed, against a fault-free run with the same seeds and data.

    trainguard drill [--steps 1000] [--out DIR]      (also: python bench/fire_drill.py)

Four runs: plain DeepSpeed without faults (the reference loss), trainguard without faults (what the
insurance costs: the guard, a disk checkpoint every 50 steps and a snapshot in memory every 10),
trainguard with the faults, plain DeepSpeed with the same faults.

The schedule (``drill.json``, written for 1,000 steps; a shorter drill scales the fault steps): one
NaN sample in one rank's batch, a burst of three poisoned batches, a corrupted newest checkpoint just
before a killed rank (the restart must pass over it; written just after a disk save, when no snapshot in
memory is newer than it, so that the corruption costs what the tier's interval bounds), an LR ramp (slow rise), a hung rank, and an
fp16 loss-scale collapse (a model whose values leave fp16's range). Every run is launched with
``torchrun --max-restarts=2``: trainguard resumes by itself from its checkpoints; plain DeepSpeed is
run as a careful user runs it (its own ``save_checkpoint`` every as many steps as trainguard's,
``load_checkpoint`` of the latest on start, its own collective timeout). The run is 2 ranks, ZeRO-2,
fp16 with DeepSpeed's dynamic loss scaler (enabled on CPU by the worker's test switch); trainguard's runs keep
disk checkpoints every 50 steps (the baseline saves as often) and the in-memory tier every 10.

Goals: trainguard completes, within 2% of the clean run's final loss, every fault within its
own goal (each fault's cost in both runs is printed: trainguard.drill.costs); plain DeepSpeed fails to complete
or ends worse: exit code 0 when they hold. Goodput over the in-process faults is printed, not judged.

May import trainguard.demo (the runs it drills) and trainguard.metrics.
"""
from __future__ import annotations

import copy
import json
import os
import sys
import time
from pathlib import Path
from typing import Sequence

from trainguard.demo.run import fresh, run_worker
from trainguard.drill.costs import format_costs, read_progress
from trainguard.drill.figures import in_process_goodput, per_fault_costs, snapshot_figures  # noqa: F401 - (the bench's)
from trainguard.metrics.jsonl import read

DRILL_CONFIG = Path(__file__).with_name("drill.json")
SCHEDULE_STEPS = 1000
LAUNCHER = ["--max-restarts=2", "--monitor-interval=0.5"]
GOALS = {"loss_within": 0.02}


def drill_config(steps: int, faults: bool = True) -> dict:
    """The packaged drill config, its fault steps scaled to a drill of ``steps`` steps."""
    cfg = json.loads(DRILL_CONFIG.read_text())
    block = cfg["trainguard"]
    if not faults:
        block.pop("faults", None)
        block["allow_faults"] = False
        return cfg
    scale = steps / SCHEDULE_STEPS
    if scale != 1:
        # what is measured in steps scales with the drill, so that a short drill keeps the schedule's
        # relations (the burst's onset outside the ladder window of the NaN before it, so that its
        # rollback meets the corrupted checkpoint; a ramp shorter than the gap to the next fault)
        rec = block.setdefault("recovery", {})
        rec["ladder_window"] = max(10, round(rec.get("ladder_window", 100) * scale))
        params = (cfg.get("scheduler") or {}).get("params") or {}
        if "warmup_num_steps" in params:
            params["warmup_num_steps"] = max(10, round(params["warmup_num_steps"] * scale))
    block["faults"] = [dict(f, step=max(1, round(f["step"] * scale)),
                            **({"steps": max(5, round(f.get("steps", 1) * scale))} if f["type"] == "lr_ramp" else {}))
                       for f in block["faults"]]
    return cfg


def _write(cfg: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg, indent=1))
    return path


def _restarts(d: Path, rc: int) -> int:
    """How many times torchrun restarted the workers: its failure lines, less a final one."""
    try:
        failures = (d / "torchrun.log").read_text(errors="replace").count("failed (exitcode")
    except OSError:
        return 0
    return max(0, failures - (1 if rc not in (0, 124) else 0))  # (124: stopped by us, not a torchrun failure)


def _last_error(d: Path, rc: int, restarts: int) -> str:
    """Why a run without a result of its own ended: the last error line of its torchrun log (e.g.
    restarted gloo workers that could not connect: PLATFORM.md)."""
    try:
        lines = (d / "torchrun.log").read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    errors = [ln.strip() for ln in lines if "Error" in ln and "Traceback" not in ln]
    return f"exit {rc} after {restarts} restart(s)" + (f": {errors[-1][:200]}" if errors else "")


def _external_goodput(d: Path, r0: dict) -> float | None:
    """A run without trainguard's meter across restarts (plain DeepSpeed restarts from step 0): the
    final attempt's productive time over the wall time since the first attempt's first step."""
    try:
        starts = [float(line.split()[1]) for line in (d / "starts.rank0.txt").read_text().splitlines()]
        wall = float(r0["t_end"]) - min(starts)
        return round(r0["goodput"]["productive_s"] / wall, 4) if wall > 0 else None
    except (OSError, KeyError, ValueError, TypeError, IndexError):
        return None


def _row(name: str, rc: int, results: list, log: Path | None, clean_loss: float | None, steps: int,
         restarts: int = 0) -> dict:
    ok = [r for r in results if r]
    r0 = ok[0] if ok else {}
    died = next((r.get("died") for r in ok if r.get("died")), None)
    completed = rc == 0 and len(ok) == len(results) and not any(r.get("aborted") for r in ok) and \
        r0.get("global_steps") == steps
    row = {"run": name, "completed": completed, "reached_step": r0.get("global_steps"),
           "died": died or (r0.get("aborted") or {}).get("message") if not completed else None,
           "eval_loss": r0.get("eval_loss") if completed else None}
    events = [x for x in read(log) if x["type"] == "event"] if log is not None and log.exists() else []
    end = next((e for e in reversed(events) if e["event"] == "run_end"), None)
    good = (end or {}).get("detail", {}).get("goodput") or r0.get("goodput") or {}
    row.update({"goodput": good.get("goodput"), "productive_s": good.get("productive_s"),
                "wall_s": good.get("wall_s"), "downtime_s": good.get("downtime_s"), "steps_lost": good.get("steps_lost"),
                "skipped_steps": good.get("skipped_steps"),
                "rollbacks": sum(1 for e in events if e["event"] == "rollback"), "restarts": restarts,
                "rollback_anomalies": sorted({e["detail"].get("anomaly") for e in events if e["event"] == "rollback"}),
                "hangs_named": [c["rank"] for e in events if e["event"] == "hang_detected"
                                for c in e["detail"]["culprits"]],
                "precision_fallback": any(e["event"] == "precision_fallback" for e in events),
                "checkpoint_invalid": sum(1 for e in events if e["event"] == "checkpoint_invalid")})
    if clean_loss and row["eval_loss"] is not None:
        row["loss_vs_clean"] = (row["eval_loss"] - clean_loss) / clean_loss
    return row


def format_table(rows: list[dict]) -> str:
    def pct(x):
        return "-" if x is None else f"{x * 100:+.2f}%"

    def num(x, fmt="{:.4f}"):
        return "-" if x is None else fmt.format(x)

    head = (f"{'run':<22}{'completed':<22}{'final loss':>11}{'vs clean':>10}{'steps lost':>12}{'goodput':>9}"
            f"{'rollbacks':>11}{'restarts':>10}{'skipped':>9}{'train s':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        done = "yes" if r["completed"] else "no (hung)" if r.get("hung") else \
            f"no (died at {r.get('reached_step')})"
        lines.append(f"{r['run']:<22}{done:<22}{num(r.get('eval_loss')):>11}{pct(r.get('loss_vs_clean')):>10}"
                     f"{num(r.get('steps_lost'), '{}'):>12}{num(r.get('goodput'), '{:.3f}'):>9}"
                     f"{r.get('rollbacks', 0):>11}{r.get('restarts', 0):>10}{num(r.get('skipped_steps'), '{}'):>9}"
                     f"{num(r.get('train_s'), '{:.1f}'):>9}")
    return "\n".join(lines)


def verdict(rows: list[dict], costs: list[dict] = ()) -> tuple[bool, list[str]]:
    """trainguard completed, within ``loss_within`` of the clean run, every fault's own goal met (``costs``' goal_met;
    None: not measurable, not counted), plain DeepSpeed died or ended worse. Goodput is printed, not judged."""
    tg, plain = ({r["run"]: r for r in rows}[k] for k in ("trainguard", "plain DeepSpeed"))
    judged = [c for c in costs if c.get("run") == "trainguard" and c.get("goal_met") is not None]
    missed = [f"{c['fault']}@{c['step']}" for c in judged if not c["goal_met"]]
    checks = [(tg["completed"], "trainguard completed"),
              (tg.get("loss_vs_clean") is not None and abs(tg["loss_vs_clean"]) <= GOALS["loss_within"],
               f"trainguard's final loss within {GOALS['loss_within']:.0%} of the clean run"),
              (bool(judged) and not missed, f"every fault's own goal met ({len(judged) - len(missed)} of {len(judged)}"
               + (f"; missed: {', '.join(missed)}" if missed else "") + ")"),
              (not plain["completed"] or (plain.get("loss_vs_clean") or 0) > (tg.get("loss_vs_clean") or 0),
               "plain DeepSpeed failed to complete or ended worse")]
    return all(ok for ok, _ in checks), [f"[{'x' if ok else ' '}] {what}" for ok, what in checks]


def drill(steps: int = SCHEDULE_STEPS, out: str | os.PathLike = "trainguard-drill", extra: Sequence[str] = (),
          stream=sys.stdout, timeout: float = 900) -> tuple[int, list[dict]]:
    out = Path(out)
    faulty = drill_config(steps)
    tg_block = faulty["trainguard"]
    every = int(tg_block.get("checkpoint", {}).get("every_steps") or 10)
    timeout_s = (tg_block.get("distributed") or {}).get("collective_timeout_s") or 60
    # the baseline as a careful user runs plain DeepSpeed: its own save_checkpoint every M steps (M as
    # trainguard's), load_checkpoint of the latest on start, DeepSpeed's own collective timeout
    careful = ["--plain", "--plain-save-every", str(every), "--plain-timeout", str(timeout_s)]
    runs = [("clean (no faults)", drill_config(steps, faults=False), ["--plain"]),
            ("trainguard, no faults", drill_config(steps, faults=False), []),
            ("trainguard", faulty, []),
            ("plain DeepSpeed", drill_config(steps), careful)]
    print(f"trainguard fire drill: 2 ranks, {steps} steps, ZeRO-2 fp16; faults at "
          + ", ".join(f"{f['type']}@{f['step']}" for f in runs[2][1]["trainguard"]["faults"]), file=stream)
    rows = []
    clean_loss = None
    bound = timeout
    folders = fresh(*(out / name.replace(",", "").replace("(", "").replace(")", "").replace(" ", "_").lower()
                      for name, _, _ in runs))  # (each run from its start: checked together before any is emptied)
    for i, (name, cfg, flags) in enumerate(runs):
        d = folders[i]
        print(f"  run {i + 1}/{len(runs)}: {name} ...", file=stream, flush=True)
        cfg = copy.deepcopy(cfg)
        ck = cfg["trainguard"].get("checkpoint", {})
        if "--plain" in flags:
            cfg["trainguard"].pop("checkpoint", None)  # plain DeepSpeed has no trainguard checkpoints
        else:
            ck["dir"] = str(d / "ckpt")
        t0 = time.monotonic()
        launched = time.time()
        rc, results = run_worker(_write(cfg, d / "ds_config.json"), d, steps, extra=[*flags, *extra],
                                 timeout=bound, launcher=LAUNCHER)
        if i == 0:
            # a run that makes no progress (plain DeepSpeed's restarted gloo workers can hang at their
            # rendezvous, PLATFORM.md; a live rank waits on a hung one) is stopped after twice the clean run's time
            bound = min(timeout, 2 * (time.monotonic() - t0) + 20)
        log = d / ("plain.jsonl" if "--plain" in flags else "trainguard.jsonl")
        row = _row(name, rc, results, None if "--plain" in flags else log, clean_loss, steps, _restarts(d, rc))
        progress = read_progress(d / "progress.rank0.txt")
        if not row["completed"] and not row.get("died"):
            row["died"] = _last_error(d, rc, row["restarts"])
        if rc == 124:
            row["hung"] = True
            row["reached_step"] = progress[-1][1] if progress else None
            row["died"] = (f"did not finish in {bound:.0f} s and was stopped, after {row['restarts']} restart(s), "
                           f"the last step done {row['reached_step']} (e.g. a live rank waiting on a hung one: "
                           "DeepSpeed's ZeRO groups are made without a timeout, 30 minutes on gloo, whatever "
                           "init_distributed was given)")
        if "--plain" in flags and row["restarts"]:
            row["goodput"] = _external_goodput(d, next((r for r in results if r), {}))
        if i == 0:
            clean_loss = row["eval_loss"]
            row["loss_vs_clean"] = 0.0 if clean_loss is not None else None
        row["dir"], row["launched"] = str(d), launched
        # first step to last, restarts included (the insurance's cost: its row against the clean one)
        row["train_s"] = round(progress[-1][2] - progress[0][2], 2) if progress else None
        rows.append(row)
    costs = per_fault_costs(rows, faulty)
    in_process_goodput(rows[2], costs)
    clean_s, insured_s = rows[0].get("train_s"), rows[1].get("train_s")
    if clean_s and insured_s:
        rows[1]["insurance_cost"] = round(insured_s / clean_s - 1, 4)
    ok, lines = verdict(rows, costs)
    print("", file=stream)
    print(format_table(rows), file=stream)
    for r in rows:
        if r.get("died"):
            print(f"  {r['run']}: {r['died'][:160]}", file=stream)
    tg = rows[2]
    if tg.get("goodput_in_process") is not None:
        print(f"  trainguard's goodput over the in-process faults (the process faults' windows -- "
              f"{tg['process_fault_s']:.1f} s, restart downtime {tg.get('downtime_s') or 0:.1f} s of it -- taken out "
              f"of the wall time): {tg['goodput_in_process']:.3f} (the per-fault costs' sum: printed, not judged)",
              file=stream)
    snaps = snapshot_figures(Path(rows[1]["dir"]), every)
    if snaps:
        rows[1]["snapshots"] = snaps
        print(f"  the in-memory tier (trainguard without faults): {snaps['count']} snapshots, "
              f"{snaps['blocking_ms_median']:.1f} ms blocking each (median; max {snaps['blocking_ms_max']:.1f}), "
              f"{snaps['write_ms_median']:.0f} ms written in the background, {snaps['shard_mb']:.1f} MB a shard, "
              f"{snaps['node_memory_mb']:.1f} MB of node memory per rank"
              + (f"; in the step times {snaps['in_run_ms']:.1f} ms a snapshot, {snaps['in_run_share']:+.1%} of the "
                 "run" if snaps["in_run_ms"] is not None else ""), file=stream)
    if rows[1].get("insurance_cost") is not None:
        print(f"  the insurance (trainguard without faults) against the clean run: "
              f"{rows[1]['insurance_cost'] * 100:+.1f}% training time (printed, not judged: two whole runs' wall "
              "times on a shared machine; bench/insurance.py judges the insurance's cost, goal <= +2%)", file=stream)
    print("", file=stream)
    print("cost per fault (steps and seconds lost against the clean run's step time):", file=stream)
    print(format_costs(costs), file=stream)
    print("", file=stream)
    print("goals:", file=stream)
    for line in lines:
        print("  " + line, file=stream)
    (out / "drill.json").write_text(json.dumps({"steps": steps, "rows": rows, "costs": costs, "goals_met": ok},
                                               indent=1))
    return (0 if ok else 1), rows
