"""A drill's figures, read from its runs' directories (trainguard.drill): each fault's cost in the trainguard run and
the baseline (trainguard.drill.costs over their progress lines and events), the goodput over the in-process faults,
and what the in-memory tier cost.
"""
from __future__ import annotations

import statistics
from pathlib import Path

from trainguard.drill.costs import cold_start, fault_cost, goal, read_progress, step_time, tier_cost
from trainguard.metrics.jsonl import read

PROCESS_FAULTS = ("kill_rank", "hang_rank")


def snapshot_figures(run_dir: Path, disk_every: int) -> dict | None:
    """What the in-memory tier cost a run (its snapshot_saved records): blocking time per snapshot, the
    background write, the shard's size and the node memory a rank's snapshots take; and its cost in the
    step times (trainguard.drill.costs.tier_cost: what the steps after each snapshot took beyond the others)."""
    log = run_dir / "trainguard.jsonl"
    saved = [x["detail"] for x in (read(log) if log.exists() else [])
             if x["type"] == "event" and x["event"] == "snapshot_saved"]
    if not saved:
        return None
    in_run = tier_cost(read_progress(run_dir / "progress.rank0.txt"), [d["step"] for d in saved], disk_every)
    return {"count": len(saved), "blocking_ms_median": statistics.median(d["blocking_s"] for d in saved) * 1e3,
            "blocking_ms_max": max(d["blocking_s"] for d in saved) * 1e3,
            "write_ms_median": statistics.median(d["write_s"] for d in saved) * 1e3,
            "blocking_and_writer_cpu_ms_median": statistics.median(d["blocking_s"] + d["write_cpu_s"]
                                                                   for d in saved) * 1e3,
            "last_interval": saved[-1]["interval"],
            "shard_mb": max(d["bytes"] for d in saved) / 1e6,
            "node_memory_mb": max(d["node_memory_bytes"] for d in saved) / 1e6,
            "in_run_ms": None if in_run is None else in_run[0] * 1e3,
            "in_run_share": None if in_run is None else in_run[1]}


def in_process_goodput(row: dict, costs: list[dict]) -> None:
    """The goodput of the in-process faults: the run's productive time over its wall time less the
    windows of the process faults (a killed or hung rank: detection, restart, steps re-run), which the
    drill reports on their own (their rows, and the restart downtime)."""
    lost = [c.get("seconds_lost") for c in costs if c["run"] == "trainguard" and c["fault"] in PROCESS_FAULTS]
    if row.get("productive_s") is None or not row.get("wall_s") or any(x is None for x in lost):
        return
    row["process_fault_s"] = round(sum(lost), 2)
    wall = row["wall_s"] - row["process_fault_s"]
    row["goodput_in_process"] = round(row["productive_s"] / wall, 4) if wall > 0 else None


def per_fault_costs(rows: list[dict], cfg: dict) -> list[dict]:
    """trainguard.drill.costs for every fault of the schedule, in the trainguard run and the baseline."""
    block = cfg["trainguard"]
    ck = block.get("checkpoint", {})
    every = int((ck.get("snapshot") or {}).get("every_steps") or ck.get("every_steps") or 10)  # S: the newest tier's
    wd = (block.get("distributed") or {}).get("watchdog") or {}
    hang_bound = float(wd.get("hang_timeout_s", 5)) + float(wd.get("interval_s", 0.5))
    by = {r["run"]: r for r in rows}
    clean = read_progress(Path(by["clean (no faults)"]["dir"]) / "progress.rank0.txt")
    clean_step = step_time(clean)
    out = []
    for f in block["faults"]:
        for name in ("trainguard", "plain DeepSpeed"):
            d = Path(by[name]["dir"])
            progress = read_progress(d / "progress.rank0.txt")
            log = d / "trainguard.jsonl"
            events = [x for x in read(log) if x["type"] == "event"] if name == "trainguard" and log.exists() else []
            row = {"run": name, **fault_cost(f, progress, events, clean_step)}
            if name == "trainguard":
                row["goal_met"], row["goal"] = goal(row, f, every, cold_start(by[name]["launched"], progress),
                                                    hang_bound)
            out.append(row)
    return out
