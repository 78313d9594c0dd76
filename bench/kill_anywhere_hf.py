"""Kill a rank anywhere in the step, under Hugging Face's Trainer (issue 38; ``python bench/kill_anywhere.py --hf
--trials N``): the unmodified Trainer script of the tests (tests/support/hf_worker.py: a tiny GPT-2, DeepSpeed ZeRO-2
bf16 through Accelerate, 2 ranks), the block in its ds_config, launched as docs/liveness.md says -- ``trainguard run
-- torchrun ... -m trainguard.supervise --spares 1 -- -m tests.support.hf_worker ...`` -- and, on some of the same
draws, under torchrun's whole-job restart. The Trainer saves a checkpoint every ``SAVE`` steps; both resume from the
newest that verifies (the Trainer's own resume: its state, scheduler, RNG and data skipping), so at most ``SAVE``
steps are redone -- the Trainer's checkpoint interval, not a node-memory snapshot's.

Per trial, as in bench/kill_anywhere.py: fault to the next optimizer step (the first step trainguard logs after the
run's ``resume`` record), steps redone, whether the run went on in-process (``rank_replaced``) or restarted whole,
whether both ranks' final parameters equal the uninterrupted run's, whether a survivor's process was restarted.
"""
from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench._kill_trials import end_trial, kill_in, outcome, report, resumed_after, topmost
from trainguard.demo.run import torchrun_env

RANKS, STEPS, SAVE = 2, 30, 4
DS = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
      "gradient_clipping": "auto", "zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"}}


def launch(out: Path, supervised: bool) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    (out / "ds_config.json").write_text(json.dumps({**DS, "trainguard": {"metrics": {"jsonl": str(
        out / "trainguard.jsonl")}, "distributed": {"watchdog": {"interval_s": 0.5, "hang_timeout_s": 10}}}}))
    head = [sys.executable, "-m", "trainguard.cli", "run", "--", sys.executable, "-m", "torch.distributed.run",
            "--standalone", f"--nproc-per-node={RANKS + (1 if supervised else 0)}", "--max-restarts=1",
            "--monitor-interval=0.1"]
    supervise = ["-m", "trainguard.supervise", "--spares", "1", "--"] if supervised else []
    worker = ["-m", "tests.support.hf_worker", "--config", str(out / "ds_config.json"), "--steps", str(STEPS),
              "--out", str(out), "--save-steps", str(SAVE), "--bf16"]
    return subprocess.Popen(head + supervise + worker, env=torchrun_env(), stdout=open(out / "log", "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def steps(out: Path) -> list[tuple[int, float]]:
    """(step, time) of each optimizer step trainguard logged (the lowest rank's metric lines), in order."""
    p = out / "trainguard.jsonl"
    rows = []
    for line in (p.read_text().splitlines() if p.exists() else ()):
        try:
            e = json.loads(line)
        except ValueError:  # (a line being written)
            continue
        if e.get("type") == "metric":
            rows.append((e["step"], e["time"]))
    return rows


def training_pid(out: Path, rank: int) -> int | None:
    """The Trainer process of this trial holding ``rank`` (its environment at start says RANK; a spare's says -1)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"tests.support.hf_worker" not in cmd or str(out).encode() not in cmd or b"trainguard.supervise" in cmd \
                    or b"torch.distributed.run" in cmd or b"trainguard.cli" in cmd:
                continue
            env = dict(x.split(b"=", 1) for x in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in x)
        except (OSError, ValueError):
            continue
        if env.get(b"RANK") == str(rank).encode():
            found.append(int(pid))
    return topmost(found)


def trial(out: Path, supervised: bool, rank: int, step: int, fraction: float, step_s: float) -> dict:
    job = launch(out, supervised)
    killed_at, last_before = kill_in(job, lambda: [r[0] for r in steps(out)], step, fraction, step_s,
                                     lambda: training_pid(out, rank), 240)
    end_trial(job, out)
    back = resumed_after(out / "trainguard.jsonl", killed_at)  # (a step logged after the kill may be the old run's)
    after = [r for r in steps(out) if back is not None and r[1] > back]
    results = [json.loads(p.read_text()) if (p := out / f"result.rank{r}.json").exists() else None
               for r in range(RANKS)]
    return {"supervised": supervised, "rank": rank, "step": step, "fraction": round(fraction, 3),
            **outcome(out / "trainguard.jsonl"), "rc": job.returncode, "fault_to_step_s": round(after[0][1] - killed_at, 3) if after else None,
            "steps_lost": (last_before - after[0][0] + 1) if after and last_before is not None else None,
            "param_sha256": [r["param_sha256"] if r else None for r in results],
            "restarted_survivors": [r for r in range(RANKS) if r != rank and results[r] is not None
                                    and results[r]["restart"] != "0"]}


def main(args) -> int:
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="kill-anywhere-hf-"))
    clean = launch(tmp / "clean", supervised=False)
    if clean.wait() != 0:
        raise SystemExit(f"the uninterrupted run failed: {tmp / 'clean' / 'log'}")
    rows = steps(tmp / "clean")
    step_s = statistics.median(b[1] - a[1] for a, b in zip(rows, rows[1:]))
    want = json.loads((tmp / "clean" / "result.rank0.json").read_text())["param_sha256"]
    print(f"uninterrupted: {STEPS} steps, {step_s * 1000:.0f} ms a step, a checkpoint every {SAVE}")
    trials = []
    restart_every = max(1, args.trials // (args.restart_trials or max(1, args.trials // 5)))
    for i in range(args.trials):
        draw = (rng.randrange(RANKS), rng.randrange(SAVE + 2, STEPS - 6), rng.random())
        for supervised in (True, False) if i % restart_every == 0 else (True,):
            t = trial(tmp / f"t{i}{'s' if supervised else 'r'}", supervised, *draw, step_s)
            t["bit_identical"] = all(h == want for h in t["param_sha256"])
            trials.append(t)
            print(json.dumps({k: v for k, v in t.items() if k != "param_sha256"}), flush=True)
    # (the goal's interval: the Trainer's checkpoints, which is what both resume from)
    return report(trials, SAVE, args.json, framework="HF Trainer (transformers) over DeepSpeed ZeRO-2, 2 ranks",
                  step_s=step_s, checkpoint_every=SAVE)
