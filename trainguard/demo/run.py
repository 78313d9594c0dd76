"""Launch the demo worker under torchrun and summarise what happened (used by the CLI and tests)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from trainguard.metrics.jsonl import read

DEFAULT_CONFIG = Path(__file__).with_name("demo.json")


def torchrun_env() -> dict:
    env = dict(os.environ)
    # DeepSpeed compiles a small C++ op at the first process-group start; cache it across runs.
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions"))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run_worker(config: str | os.PathLike, out: str | os.PathLike, steps: int, nproc: int = 2,
               extra: Sequence[str] = (), timeout: float = 300, log_name: str = "torchrun.log") -> tuple[int, list[dict]]:
    """Run ``nproc`` ranks of trainguard.demo.worker; return ``(exit code, per-rank results)``.

    Bounded: the whole process group is killed after ``timeout`` seconds (exit code 124), so a
    hung collective can never hang the caller.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "trainguard.demo.worker", "--config", str(config), "--steps", str(steps), "--out", str(out),
           *extra]
    with open(out / log_name, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=torchrun_env(),
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = 124
    results = []
    for r in range(nproc):
        p = out / f"result.rank{r}.json"
        results.append(json.loads(p.read_text()) if p.exists() else None)
    return rc, results


def fault_table(events: list[dict]) -> list[dict]:
    """One row per injected fault or verdict: step, rank, fault, verdict, action."""
    rows: dict[tuple[int, int], dict] = {}
    for e in events:
        if e.get("type") != "event":
            continue
        if e["event"] == "fault_injected":
            for f in e["detail"].get("faults", []):
                row = rows.setdefault((e["step"], f["rank"]), {"step": e["step"], "rank": f["rank"]})
                row["fault"] = f["type"]
        elif e["event"] in ("nonfinite",):
            for r in e["ranks"]:
                d = e["detail"].get("per_rank", {}).get(str(r), {})
                row = rows.setdefault((e["step"], r), {"step": e["step"], "rank": r})
                row["verdict"] = f"{e['event']} ({d.get('origin', '?')})"
                row["action"] = e["action"]
                row["samples"] = d.get("sample_ids", [])
        elif e["event"] == "framework_skip":
            row = rows.setdefault((e["step"], -1), {"step": e["step"], "rank": -1})
            row["verdict"] = "skipped by DeepSpeed itself"
    return [rows[k] for k in sorted(rows)]


def format_rows(rows: list[dict]) -> str:
    head = f"{'step':>5}  {'rank':>4}  {'fault':<10} {'verdict':<22} {'action':<10} samples"
    lines = [head, "-" * len(head)]
    for r in rows:
        samples = r.get("samples") or []
        shown = ",".join(map(str, samples[:4])) + (",..." if len(samples) > 4 else "")
        lines.append(f"{r['step']:>5}  {r['rank'] if r['rank'] >= 0 else '-':>4}  {r.get('fault', '-'):<10} "
                     f"{r.get('verdict', 'none'):<22} {r.get('action', '-'):<10} {shown}")
    return "\n".join(lines)


def summarise(results: list[dict | None]) -> dict:
    ok = [r for r in results if r]
    if not ok:
        return {"completed": False}
    return {
        "completed": len(ok) == len(results) and not any(r["aborted"] for r in ok),
        "steps": ok[0]["global_steps"],
        "skipped": sorted({r["skipped_steps"] for r in ok}),
        "weights_finite": all(r["weights_finite"] for r in ok),
        "eval_loss": ok[0]["eval_loss"],
        "same_weights_on_all_ranks": len({r["param_sha256"] for r in ok}) == 1,
    }


def demo(config: str | os.PathLike | None, steps: int, out: str | os.PathLike, extra: Sequence[str] = (),
         stream=sys.stdout) -> int:
    config = Path(config) if config else DEFAULT_CONFIG
    out = Path(out)
    print(f"trainguard demo: 2 ranks, {steps} steps, config {config}", file=stream)
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
    print("", file=stream)
    print(f"event log: {out / 'trainguard' / 'trainguard.jsonl'}", file=stream)
    return 0
