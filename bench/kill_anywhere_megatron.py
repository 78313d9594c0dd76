"""Kill a rank anywhere in the iteration, on Megatron-LM's own loop (issue 38; ``python bench/kill_anywhere.py
--megatron-lm --trials N``): Megatron-LM's unmodified ``pretrain_gpt.py`` (core_v0.19.0, ../shared's checkout, on
the CPU layer its tests use) at DP=2 with a tiny GPT, 20 iterations, trainguard's snapshots to node memory every 2,
launched the way docs/liveness.md says -- under ``trainguard.supervise --spares 1`` and, on some of the same draws,
under torchrun's whole-job restart. Each trial draws the rank, the iteration and the moment within it, waits for that
iteration in Megatron-LM's own log and SIGKILLs the rank's training process.

Per trial, as in bench/kill_anywhere.py: fault to the next iteration Megatron-LM logs, iterations redone, whether
the run went on in-process (``rank_replaced``) or restarted whole, and whether the last iteration's loss and learning
rate equal the uninterrupted run's (Megatron-LM prints the loss to 7 significant digits: the check a user can make).
"""
from __future__ import annotations

import datetime
import json
import os
import random
import re
import signal
import subprocess
import tempfile
import uuid
from pathlib import Path

from bench._kill_trials import kill_in, outcome, report, resumed_after, topmost

ITERS, EVERY, DP = 20, 2, 2
STAMP = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+)\] iteration\s+(\d+)/")


def launch(release, out: Path, supervised: bool, marker: str) -> subprocess.Popen:
    from tests.dist.test_megatron_lm_dist import BIN, ROOT, TINY

    out.mkdir(parents=True, exist_ok=True)
    cfg = out / "tg.json"
    cfg.write_text(json.dumps({"trainguard": {
        "metrics": {"jsonl": str(out / "trainguard.jsonl")},
        "checkpoint": {"dir": str(out / "snapshots"), "snapshot": {"every_steps": EVERY, "dir": str(out / "shm")}}}}))
    head = [str(BIN / "trainguard"), "run", "--", str(BIN / "torchrun"), "--standalone", "--nproc-per-node",
            str(DP + (1 if supervised else 0)), "--max-restarts=1", "--monitor-interval=0.1"]
    supervise = ["-m", "trainguard.supervise", "--spares", "1", "--"] if supervised else []
    cmd = [*head, *supervise, str(release.checkout / "pretrain_gpt.py"), *TINY, "--train-iters", str(ITERS),
           "--trainguard-config", str(cfg)]
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1", TRAINGUARD_TEST_ROOT=str(ROOT),
               PYTHONPATH=release.pythonpath(), TRAINGUARD_TEST_RUN=marker)
    return subprocess.Popen(cmd, cwd=out, env=env, stdout=open(out / "megatron.log", "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def iterations(out: Path) -> list[tuple[int, float]]:
    """(iteration, the time Megatron-LM logged it) in the order logged."""
    p = out / "megatron.log"
    text = p.read_text(errors="replace") if p.exists() else ""
    return [(int(m[2]), datetime.datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S.%f").timestamp())
            for m in STAMP.finditer(text)]


def last_line(out: Path) -> dict | None:
    from tests.dist.test_megatron_lm_dist import LINE

    found = None
    for m in LINE.finditer((out / "megatron.log").read_text(errors="replace")):
        if int(m[1]) == ITERS:
            found = {"lr": m[3], "loss": m[4]}
    return found


def training_pid(marker: str, rank: int) -> int | None:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            env = dict(x.split(b"=", 1) for x in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in x)
        except (OSError, ValueError):
            continue
        if env.get(b"TRAINGUARD_TEST_RUN") == marker.encode() and b"pretrain_gpt.py" in cmd and \
                b"trainguard.supervise" not in cmd and b"torchrun" not in cmd and env.get(b"RANK") == str(rank).encode():
            found.append(int(pid))
    return topmost(found)  # (never one of its data-loader workers)


def trial(release, out: Path, supervised: bool, rank: int, step: int, fraction: float, step_s: float) -> dict:
    marker = uuid.uuid4().hex
    job = launch(release, out, supervised, marker)
    killed_at, last_before = kill_in(job, lambda: [r[0] for r in iterations(out)], step, fraction, step_s,
                                     lambda: training_pid(marker, rank), 300)
    if job.poll() is None:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    from tests.dist.test_megatron_lm_dist import kill_marked

    kill_marked(marker)  # (torchrun's workers are sessions of their own: what a timed-out trial left behind)
    back = resumed_after(out / "trainguard.jsonl", killed_at)  # (a line after the kill may be the old run's)
    after = [r for r in iterations(out) if back is not None and r[1] > back]
    went = outcome(out / "trainguard.jsonl")
    fell_back = went["fell_back"]
    return {"supervised": supervised, "rank": rank, "step": step, "fraction": round(fraction, 3), **went,
            "rc": job.returncode,
            "fault_to_step_s": round(after[0][1] - killed_at, 3) if after else None,
            "steps_lost": (last_before - after[0][0] + 1) if after and last_before is not None else None,
            "last": last_line(out), "restarted_survivors": [r for r in range(DP) if r != rank] if fell_back else []}


def main(args) -> int:
    from tests.dist.test_megatron_lm_dist import Release

    release = Release("core_v0.19.0")
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="kill-anywhere-megatron-"))
    clean = launch(release, tmp / "clean", False, uuid.uuid4().hex)
    if clean.wait() != 0 or not iterations(tmp / "clean"):
        raise SystemExit(f"the uninterrupted run failed: {tmp / 'clean' / 'megatron.log'}")
    rows = iterations(tmp / "clean")
    step_s = sorted(b[1] - a[1] for a, b in zip(rows, rows[1:]))[len(rows) // 2 - 1]
    want = last_line(tmp / "clean")
    print(f"uninterrupted: {ITERS} iterations, {step_s * 1000:.0f} ms an iteration, last {want}")
    trials = []
    restart_every = max(1, args.trials // (args.restart_trials or max(1, args.trials // 5)))
    for i in range(args.trials):
        draw = (rng.randrange(DP), rng.randrange(4, ITERS - 4), rng.random())
        for supervised in (True, False) if i % restart_every == 0 else (True,):
            t = trial(release, tmp / f"t{i}{'s' if supervised else 'r'}", supervised, *draw, step_s)
            t["bit_identical"] = t["last"] == want and want is not None
            trials.append(t)
            print(json.dumps(t), flush=True)
    return report(trials, EVERY, args.json, framework="Megatron-LM core_v0.19.0, DP=2", step_s=step_s)
