"""Kill a rank anywhere in the step (issue 38): a rank's training process SIGKILLed at a random moment -- whatever
it was doing: a forward, a backward, an all-reduce, a snapshot's write, a disk save -- under trainguard.supervise
with a hot spare, against today's whole-job restart (torchrun --max-restarts 1) on the same kill points, in the same
run.

    python bench/kill_anywhere.py --trials 100 [--json bench/results/kill-anywhere-<date>.json]

DeepSpeed ZeRO-2 bf16, 3 ranks (and a spare), the demo's TinyGPT, snapshots to node memory every 2 steps, disk
checkpoints every 5. Each trial draws the rank, the step and the moment within the step, launches the run, waits for
that step on rank 0's progress file, sleeps the drawn fraction of a step and kills the rank's training process.

Supervised runs keep ``--max-restarts 1``: a kill the in-process replacement does not survive falls back to the
whole-job restart, and counts (``fell_back_to_restart``). Per trial: fault to the next optimizer step (the first progress line after the kill), steps lost (the last step
before the kill minus the step the run went on from), whether the final parameters equal an uninterrupted run's,
whether a survivor's process began twice. Goals (the issue's, this machine): supervised median <= 2 s, p99 <= 5 s,
at most one snapshot interval lost, bit-identical, survivors never restarted. Exits 1 when one is missed.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainguard.demo.run import torchrun_env  # noqa: E402

RANKS, STEPS, SNAPSHOT_EVERY = 3, 30, 2


def config(out: Path) -> Path:
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "steps_per_print": 10 ** 9, "zero_optimization": {"stage": 2}, "bf16": {"enabled": True},
           "trainguard": {"metrics": {"per_rank": True},
                          "checkpoint": {"dir": str(out / "ck"), "every_steps": 5, "stable_after": 2,
                                         "snapshot": {"every_steps": SNAPSHOT_EVERY, "dir": str(out / "shm")}},
                          "distributed": {"collective_timeout_s": 120,
                                          "watchdog": {"interval_s": 0.5, "hang_timeout_s": 10}}}}
    path = out / "ds.json"
    path.write_text(json.dumps(cfg))
    return path


def launch(out: Path, supervised: bool) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    head = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--monitor-interval=0.1",
            f"--nproc-per-node={RANKS + (1 if supervised else 0)}", "--max-restarts=1"]  # (supervised: the fallback)
    worker = ["-m", "trainguard.demo.worker", "--config", str(config(out)), "--steps", str(STEPS), "--out",
              str(out / "run")]
    cmd = head + (["-m", "trainguard.supervise", "--spares", "1", "--"] if supervised else []) + worker
    env = {**torchrun_env(), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, env=env, stdout=open(out / "log", "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def progress(out: Path) -> list[tuple[int, int, float]]:
    """(attempt, step, time) per optimizer step on rank 0."""
    p = out / "run" / "progress.rank0.txt"
    if not p.exists():
        return []
    rows = []
    for line in p.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 3:
            rows.append((int(parts[0]), int(parts[1]), float(parts[2])))
    return rows


def topmost(pids: list[int]) -> int | None:
    """Of the processes matching a rank's training command, the one whose parent is not among them: a training
    process's forked data-loader workers share its command line and environment (killing one instead is another
    fault -- the rank then ends by itself, and the job restarts whole: a first 100-draw Megatron-LM run met it once)."""
    def parent(pid):
        try:
            return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return None
    top = [p for p in pids if parent(p) not in pids]
    return top[0] if len(top) == 1 else None


def training_pid(out: Path, rank: int) -> int | None:
    """The demo worker process of this trial holding ``rank`` (its environment says RANK; a spare's says -1)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if str(out / "run").encode() not in cmd or b"trainguard.supervise" in cmd or b"torch.distributed.run" in cmd:
                continue
            env = dict(x.split(b"=", 1) for x in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in x)
        except (OSError, ValueError):
            continue
        if env.get(b"RANK") == str(rank).encode():
            found.append(int(pid))
    return topmost(found)


def resumed_after(jsonl: Path, killed_at: float | None) -> float | None:
    """When the run resumed after the kill (its ``resume`` record; the records' clock is to 10 ms)."""
    if killed_at is None or not jsonl.exists():
        return None
    times = [e["time"] for e in map(json.loads, jsonl.read_text().splitlines())
             if e.get("event") == "resume" and e["time"] >= killed_at - 0.01]
    return min(times) if times else None


def kill_in(job, logged, step: int, fraction: float, step_s: float, find_pid, within_s: float):
    """Wait for ``step`` among the steps the run logged (``logged()``), sleep the drawn fraction of a step and SIGKILL
    the training process ``find_pid()`` names; then wait for the job (at most ``within_s`` in all). Returns (when it
    was killed, the last step logged before), (None, None) if it never was."""
    deadline = time.monotonic() + within_s
    killed_at = last_before = None
    while time.monotonic() < deadline and job.poll() is None:
        steps = logged()
        if killed_at is None and steps and steps[-1] >= step:
            time.sleep(fraction * step_s)
            pid = find_pid()
            if pid is not None:
                last_before = logged()[-1]
                killed_at = time.time()
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)
    return killed_at, last_before


def end_trial(job, folder: Path) -> None:
    """The trial's job ended (its process group killed if it still runs), and any process left whose command line
    names ``folder`` (torchrun's workers are sessions of their own: what a timed-out trial left)."""
    if job.poll() is None:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and str(folder).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass


def outcome(jsonl: Path) -> dict:
    """Whether the run went on in-process (``rank_replaced``) or fell back to torchrun's restart, from its log."""
    log = jsonl.read_text() if jsonl.exists() else ""
    return {"in_process": '"rank_replaced"' in log, "fell_back": '"event":"restart"' in log.replace(" ", "")}


def trial(out: Path, supervised: bool, rank: int, step: int, fraction: float, step_s: float) -> dict:
    job = launch(out, supervised)
    killed_at, last_before = kill_in(job, lambda: [r[1] for r in progress(out)], step, fraction, step_s,
                                     lambda: training_pid(out, rank), 240)
    end_trial(job, out / "run")
    rows = progress(out)
    # the next step after the fault: the first one logged after the run resumed (a step logged after the kill may
    # still be the old run's: the dead rank had done its part of it)
    back = resumed_after(out / "run" / "trainguard.jsonl", killed_at)
    after = [r for r in rows if back is not None and r[2] > back and (supervised or r[0] > 0)]
    results = [json.loads(p.read_text()) if (p := out / "run" / f"result.rank{r}.json").exists() else None
               for r in range(RANKS)]
    starts = {r: len((out / "run" / f"starts.rank{r}.txt").read_text().splitlines())
              if (out / "run" / f"starts.rank{r}.txt").exists() else 0 for r in range(RANKS)}
    return {"supervised": supervised, "rank": rank, "step": step, "fraction": round(fraction, 3),
            **outcome(out / "run" / "trainguard.jsonl"), "rc": job.returncode, "fault_to_step_s": round(after[0][2] - killed_at, 3) if after else None,
            "steps_lost": (last_before - after[0][1] + 1) if after and last_before is not None else None,
            "param_sha256": [r["param_sha256"] if r else None for r in results],
            "restarted_survivors": [r for r in range(RANKS) if r != rank and starts[r] > 1]}


def summary(ts: list[dict]) -> dict:
    times = sorted(t["fault_to_step_s"] for t in ts if t["fault_to_step_s"] is not None)
    return {"trials": len(ts), "finished": sum(t["rc"] == 0 for t in ts),
            "median_s": statistics.median(times) if times else None,
            "p99_s": times[min(len(times) - 1, int(round(0.99 * (len(times) - 1))))] if times else None,
            "max_steps_lost": max((t["steps_lost"] or 0) for t in ts) if ts else None,
            "bit_identical": sum(t["bit_identical"] for t in ts), "in_process": sum(t["in_process"] for t in ts),
            "fell_back_to_restart": sum(t["fell_back"] for t in ts),
            "survivors_restarted": sum(bool(t["restarted_survivors"]) for t in ts)}


def report(trials: list[dict], interval: int, json_path: str | None, **figures) -> int:
    """The two summaries, their ratio and the issue's goals (``interval``: the snapshot interval, in steps); 0 when
    every goal is met."""
    sup, rst = summary([t for t in trials if t["supervised"]]), summary([t for t in trials if not t["supervised"]])
    print(f"supervised (a spare):  {sup}")
    print(f"torchrun restart:      {rst}")
    if sup["median_s"] and rst["median_s"]:
        print(f"median ratio supervised / restart: {sup['median_s'] / rst['median_s']:.2f}")
    goals = {"median <= 2 s": (sup["median_s"] or 99) <= 2, "p99 <= 5 s": (sup["p99_s"] or 99) <= 5,
             "<= one snapshot interval lost": (sup["max_steps_lost"] or 0) <= interval + 1,
             "bit-identical": sup["bit_identical"] == sup["trials"],
             "survivors never restarted": sup["survivors_restarted"] == 0}
    for goal, met in goals.items():
        print(f"  {'met   ' if met else 'MISSED'} {goal}")
    if json_path:
        from bench._results import keep

        keep(json_path, {**figures, "supervised": sup, "restart": rst, "goals": goals, "trials": trials})
    return 0 if all(goals.values()) else 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--restart-trials", type=int, default=None, help="of them, also under torchrun's restart")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--megatron-lm", action="store_true", help="Megatron-LM's pretrain_gpt.py at DP=2 instead "
                    "(bench/kill_anywhere_megatron.py; needs ../shared's checkout, as its tests do)")
    ap.add_argument("--hf", action="store_true", help="Hugging Face's Trainer over DeepSpeed, zero-code, 2 ranks "
                    "(bench/kill_anywhere_hf.py)")
    args = ap.parse_args()
    if args.hf:
        from bench.kill_anywhere_hf import main as hf

        return hf(args)
    if args.megatron_lm:
        from bench.kill_anywhere_megatron import main as megatron

        return megatron(args)
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="kill-anywhere-"))
    clean = launch(tmp / "clean", supervised=False)
    if clean.wait() != 0:
        raise SystemExit(f"the uninterrupted run failed: {tmp / 'clean' / 'log'}")
    rows = progress(tmp / "clean")
    step_s = statistics.median(b[2] - a[2] for a, b in zip(rows, rows[1:]))
    want = json.loads((tmp / "clean" / "run" / "result.rank0.json").read_text())["param_sha256"]
    print(f"uninterrupted: {STEPS} steps, {step_s * 1000:.0f} ms a step")
    trials = []
    restart_every = max(1, args.trials // (args.restart_trials or max(1, args.trials // 5)))
    for i in range(args.trials):
        draw = (rng.randrange(RANKS), rng.randrange(6, STEPS - 6), rng.random())
        for supervised in (True, False) if i % restart_every == 0 else (True,):
            t = trial(tmp / f"t{i}{'s' if supervised else 'r'}", supervised, *draw, step_s)
            t["bit_identical"] = all(h == want for h in t["param_sha256"])
            trials.append(t)
            print(json.dumps({k: v for k, v in t.items() if k != "param_sha256"}), flush=True)

    return report(trials, SNAPSHOT_EVERY, args.json, step_s=step_s)


if __name__ == "__main__":
    sys.exit(main())
