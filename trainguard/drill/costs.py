"""What each fault of a drill cost: steps and seconds lost, time to detect, time to train again, the
rung taken -- for trainguard and for the baseline alike, from the same per-step progress lines.

``progress``: rank 0's ``progress.rank0.txt`` of a run (one line per optimizer step: restart attempt,
step reached, wall time, whether the update was applied), in the order written, across restarts.
``events``: trainguard's event records (empty for the baseline: it has none). Pure functions.

For a fault at step ``s`` lasting ``n`` steps the window opens when the run first reached ``s - 1``
(in the restart attempt the fault fires in) and closes when it first got past ``s + n - 1`` after it.
Inside the window: ``steps_lost`` = steps executed beyond the net progress (re-run after a rollback or
a restart) + steps not applied (skipped); ``seconds_lost`` = the window's length less what those
``n + 1`` steps take in the run without faults. A corrupted checkpoint costs what the load that met it
lost: the steps between the corrupted checkpoint and the one loaded instead (none when the load took a
newer tier: a snapshot in memory).
"""
from __future__ import annotations

import statistics
from pathlib import Path

RESPONSE = {"nonfinite", "instant_burst", "slow_rise", "loss_scale", "hang_detected", "rollback", "restart",
            "checkpoint_invalid", "precision_fallback", "overflow", "abort"}


def read_progress(path: Path) -> list[tuple[int, int, float, int]]:
    """(attempt, step, time, applied) per line; a torn last line (a killed process) is dropped."""
    rows = []
    try:
        text = Path(path).read_text()
    except OSError:
        return rows
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 4:
            try:
                rows.append((int(parts[0]), int(parts[1]), float(parts[2]), int(parts[3])))
            except ValueError:
                continue
    return rows


def step_time(progress: list[tuple[int, int, float, int]]) -> float | None:
    """The median time per step of a run (between consecutive lines of one attempt)."""
    gaps = [b[2] - a[2] for a, b in zip(progress, progress[1:]) if a[0] == b[0] and b[1] == a[1] + 1]
    return statistics.median(gaps) if gaps else None


def _span(f: dict) -> int:
    return int(f.get("steps", 1)) if f["type"] in ("nan_batch", "nan_loss", "lr_ramp", "fp16_overflow", "spike_batch",
                                                    "inf_grad", "slow_rank") else 1


def fault_cost(f: dict, progress: list, events: list[dict], clean_step_s: float | None) -> dict:
    """One fault's cost in one run (see the module docstring)."""
    s, n = int(f["step"]), _span(f)
    row: dict = {"fault": f["type"], "step": s, "steps": n}
    if f["type"] == "corrupt_checkpoint":
        return {**row, **_corruption_cost(f, events)}
    attempt = int(f.get("attempt", 0)) if f["type"] in ("kill_rank", "hang_rank") else None
    start = next((i for i, p in enumerate(progress) if p[1] == s - 1 and (attempt is None or p[0] == attempt)), None)
    if start is None:
        return {**row, "reached": False}
    t0 = progress[start][2]
    end = next((i for i in range(start + 1, len(progress)) if progress[i][1] >= s + n), None)
    window = progress[start + 1:(end + 1) if end is not None else len(progress)]
    responses = [e for e in events if e.get("time", 0) > t0 and e["event"] in RESPONSE and
                 (end is None or e["time"] <= progress[end][2])]
    row["rung"] = _rung(responses)
    row["rollbacks"] = sum(1 for e in responses if e["event"] == "rollback")
    row["restarts"] = len({p[0] for p in window} - {progress[start][0]})
    detected = next((e for e in responses), None)
    row["time_to_detect_s"] = round(detected["time"] - t0, 2) if detected else None
    if end is None:
        row.update({"recovered": False, "steps_lost": None, "seconds_lost": None})
        return row
    t_end = progress[end][2]
    executed = len(window)
    skipped = sum(1 for p in window if not p[3])
    row["recovered"] = True
    row["steps_lost"] = max(0, executed - (n + 1)) + skipped
    row["seconds_lost"] = round(t_end - t0 - (n + 1) * clean_step_s, 2) if clean_step_s else None
    if detected:
        again = next((p for p in window if p[2] > detected["time"] and p[3]), None)
        row["time_to_train_again_s"] = round(again[2] - detected["time"], 2) if again else None
    named = [e for e in responses if e["event"] in ("nonfinite", "instant_burst")]
    row["samples_named"] = sorted({i for e in named for d in (e["detail"].get("per_rank") or {}).values()
                                   for i in d.get("sample_ids", [])}) or None
    row["narrowed"] = any("narrowed" in d for e in named for d in (e["detail"].get("per_rank") or {}).values())
    if f["type"] in ("kill_rank", "hang_rank"):
        restart = next((e for e in responses if e["event"] == "restart"), None)
        row["downtime_s"] = (restart["detail"].get("downtime_s") if restart else None) if events else \
            _gap_across_restart(window, progress[start])
        # what a corrupted checkpoint the restart passed over added is that fault's cost, in its own row: taken out
        # of this one (a step is counted in one row only: the rows add up to the run's losses)
        row["corruption_steps"] = _passed_over([e for e in events if t0 < e.get("time", 0) <= t_end])
        if row["corruption_steps"]:
            row["steps_lost"] = max(0, row["steps_lost"] - row["corruption_steps"])
            if row["seconds_lost"] is not None:
                row["seconds_lost"] = round(row["seconds_lost"] - row["corruption_steps"] * clean_step_s, 2)
    if f["type"] == "hang_rank":
        hang = next((e for e in responses if e["event"] == "hang_detected"), None)
        row["named_ranks"] = [c["rank"] for c in hang["detail"]["culprits"]] if hang else []
    if f["type"] == "fp16_overflow":
        scale = next((e for e in responses if e["event"] == "loss_scale"), None)
        row["descent_steps"] = (scale["step"] - scale["detail"].get("onset_step", scale["step"]) + 1) if scale else None
    if f["type"] == "lr_ramp":
        rise = next((e for e in responses if e["event"] in ("slow_rise", "rollback")), None)
        row["detected_at_step"] = rise["step"] if rise else None
    return row


def _passed_over(events: list[dict]) -> int:
    """Steps between the newest disk checkpoint a load passed over as invalid and the state it loaded (0: none)."""
    bad = [_tag_step(e["detail"].get("tag", "")) for e in events
           if e["event"] == "checkpoint_invalid" and e["detail"].get("tier") != "memory"]
    loaded = next((e for e in events if e["event"] == "resume"), None)
    if not bad or loaded is None or loaded["detail"].get("step") is None:
        return 0
    return max(0, max(bad) - int(loaded["detail"]["step"]))


def _tag_step(tag: str) -> int:
    return int("".join(c for c in tag if c.isdigit()) or 0)


def _gap_across_restart(window: list, before) -> float | None:
    """Without trainguard's restart record: from the last step of the failed attempt to the first step
    of the next one."""
    prev = before
    for p in window:
        if p[0] != prev[0]:
            return round(p[2] - prev[2], 2)
        prev = p
    return None


def _rung(responses: list[dict]) -> str:
    """What was done, in order, compressed: e.g. ``skip_step x3``, ``rollback(nonfinite)->430``."""
    parts: list[str] = []
    for e in responses:
        ev, act = e["event"], e.get("action")
        if ev in ("nonfinite", "instant_burst", "overflow") and act == "skip_step":
            label = "skip_step"
        elif ev == "rollback":
            d = e["detail"]
            label = f"{'rollback_lower_lr' if d.get('lr_factor') else 'rollback'}->{d.get('to_step')}"
        elif ev == "precision_fallback":
            label = "bf16"
        elif ev == "restart":
            label = f"restart->{(e.get('detail') or {}).get('resumed_at_step', e.get('step'))}"
        elif ev == "hang_detected":
            label = "hang named"
        elif ev == "checkpoint_invalid":
            label = "passed over corrupt ckpt"
        elif ev == "abort":
            label = "abort"
        else:
            continue
        if parts and parts[-1].split(" x")[0] == label:
            k = int(parts[-1].split(" x")[1]) if " x" in parts[-1] else 1
            parts[-1] = f"{label} x{k + 1}"
        else:
            parts.append(label)
    return ", ".join(parts) or "-"


def _corruption_cost(f: dict, events: list[dict]) -> dict:
    """The load that met the corrupted checkpoint: which tag it passed over, which it loaded."""
    fired = next((e for e in events if e["event"] == "fault_injected" and
                  any(x.get("type") == "corrupt_checkpoint" for x in e["detail"].get("faults", []))), None)
    t0 = fired["time"] if fired else 0.0
    invalid = next((e for e in events if e["event"] == "checkpoint_invalid" and e["time"] > t0), None)
    if invalid is None:
        return {"met": False, "rung": "-", "steps_lost": None}
    loaded = next((e for e in events if e["event"] in ("resume", "rollback") and e["time"] >= invalid["time"]), None)
    bad = invalid["detail"].get("tag", "")
    bad_step = _tag_step(bad)
    to = (loaded or {}).get("detail", {}).get("to_step") if (loaded or {}).get("event") == "rollback" else \
        (loaded or {}).get("detail", {}).get("step")
    return {"met": True, "rung": f"passed over {bad}" + (f", loaded step {to}" if to is not None else ""),
            # (a load that took a newer tier -- a snapshot in memory -- lost nothing to the corruption)
            "steps_lost": max(0, bad_step - int(to)) if to is not None else None, "met_by": (loaded or {}).get("event")}


def goal(row: dict, f: dict, every_steps: int, cold_start_s: float | None, hang_bound_s: float) -> tuple[bool | None, str]:
    """The drill's goal for this fault, and whether the row meets it (None: not measurable here)."""
    kind, k, lost = f["type"], row.get("steps", 1), row.get("steps_lost")
    if kind in ("nan_batch", "nan_loss", "inf_grad", "spike_batch") and k == 1:
        return (lost is not None and lost <= 1 and row.get("rollbacks") == 0 and bool(row.get("narrowed")),
                "1 step lost, 0 rollbacks, the bad sample named")
    if kind in ("nan_batch", "nan_loss", "spike_batch"):
        return lost is not None and lost <= k and row.get("rollbacks") == 0, f"{k} steps lost, 0 rollbacks"
    if kind == "lr_ramp":
        at = row.get("detected_at_step")
        bound = (at - row["step"] + every_steps) if at is not None else 0  # (never detected: it cost nothing)
        return (lost is not None and lost <= bound,
                f"<= detection delay + {every_steps} steps" + (f" (= {bound})" if bound is not None else ""))
    if kind == "fp16_overflow":
        d = row.get("descent_steps")
        bound = d + every_steps if d is not None else None
        return (lost is not None and bound is not None and lost <= bound and row.get("restarts") == 0
                and "bf16" in row.get("rung", ""),
                f"<= the scaler's descent + {every_steps} steps" + (f" (= {bound})" if bound is not None else "")
                + ", no restart, then bf16")
    if kind == "corrupt_checkpoint":  # (the schedule has no snapshot newer than it: the tier bounds what it costs)
        return lost is not None and lost <= every_steps, f"<= {every_steps} extra steps (S; the disk alone: its interval)"
    if kind == "kill_rank":
        down = row.get("downtime_s")  # (a corrupted checkpoint it met: that fault's cost, in that fault's row)
        ok = lost is not None and lost <= every_steps and down is not None and cold_start_s is not None and \
            down <= cold_start_s + 2
        cold = f"{cold_start_s:.1f}" if cold_start_s is not None else "?"
        return ok, f"<= {every_steps} steps lost; downtime <= cold start ({cold} s) + 2 s"
    if kind == "hang_rank":
        t = row.get("time_to_detect_s")
        return t is not None and t <= hang_bound_s and bool(row.get("named_ranks")), \
            f"named within {hang_bound_s:g} s (hang_timeout_s + interval_s)"
    return None, "-"


def cold_start(launched: float | None, progress: list) -> float | None:
    """The job's cold start: from its launch (torchrun started) to its first step."""
    return round(progress[0][2] - launched, 2) if progress and launched else None


def format_costs(rows: list[dict]) -> str:
    """The per-fault table: one line per fault and run."""
    def f(x, fmt="{:.1f}"):
        return "-" if x is None else fmt.format(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else str(x)

    head = (f"{'fault':<20}{'step':>5}  {'run':<16}{'steps lost':>11}{'s lost':>8}{'detect s':>9}{'again s':>8}"
            f"  {'rung':<44} goal")
    lines = [head, "-" * (len(head) + 30)]
    for r in rows:
        mark = {True: "[x]", False: "[ ]", None: "   "}[r.get("goal_met")]
        lines.append(f"{r['fault']:<20}{r['step']:>5}  {r['run']:<16}{f(r.get('steps_lost'), '{}'):>11}"
                     f"{f(r.get('seconds_lost')):>8}{f(r.get('time_to_detect_s')):>9}{f(r.get('time_to_train_again_s')):>8}"
                     f"  {str(r.get('rung') or '-')[:44]:<44} {mark} {r.get('goal', '')}")
    return "\n".join(lines)


def tier_cost(progress: list, snapshots: list[int], disk_every: int, window: int = 3) -> tuple[float, float] | None:
    """The tier's cost measured inside one run, far less noisy than two runs' wall times: the steps just after
    each snapshot (its blocking copy, the steps its writer overlapped: ``window`` steps) against the mean of
    the others (the steps after a disk checkpoint left out). Returns (seconds per snapshot, share of the run)."""
    dts = {b[1]: b[2] - a[2] for a, b in zip(progress, progress[1:]) if b[0] == a[0]}
    near = {k + i for k in snapshots for i in range(1, window + 1)}
    disk = {k + i for k in range(0, max(dts, default=0) + 1, disk_every) for i in range(1, window + 2)}
    others = [t for s, t in dts.items() if s not in near and s not in disk]
    tier = [t for s, t in dts.items() if s in near and s not in disk]
    if not tier or len(others) < 10:
        return None
    extra = sum(tier) - len(tier) * statistics.fmean(others)
    return extra / len(snapshots), extra / sum(dts.values())
