"""What the kill-anywhere benches share (bench/kill_anywhere.py: DeepSpeed; _hf.py: HF's Trainer; _megatron.py:
Megatron-LM): finding a rank's training process, killing it at the drawn moment, ending a trial, reading its outcome,
and the report against the goals. A module of its own, so that no bench imports another that imports it back."""
from __future__ import annotations

import json
import os
import signal
import statistics
import time
from pathlib import Path


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
