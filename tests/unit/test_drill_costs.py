"""trainguard.drill.costs: a fault's cost from per-step progress lines and the event records."""
from trainguard.drill.costs import _rung, fault_cost, goal, read_progress, step_time, tier_cost


def lines(*segments):
    """(attempt, first step, last step, t0, applied-by-step) -> progress rows at 1 s per step."""
    out = []
    for attempt, a, b, t0, skipped in segments:
        out += [(attempt, s, t0 + (s - a), 0 if s in skipped else 1) for s in range(a, b + 1)]
    return out


def test_a_skip_costs_its_steps_and_a_rollback_what_it_redid():
    skip = lines((0, 1, 20, 0.0, {10, 11}))
    ev = [{"event": "nonfinite", "time": 9.5, "step": 10, "action": "skip_step", "detail": {}},
          {"event": "nonfinite", "time": 10.5, "step": 11, "action": "skip_step", "detail": {}}]
    row = fault_cost({"type": "nan_batch", "step": 10, "steps": 2}, skip, ev, 1.0)
    assert row["steps_lost"] == 2 and row["rollbacks"] == 0 and row["rung"] == "skip_step x2"
    assert row["seconds_lost"] == 0.0 and row["time_to_detect_s"] == 1.5
    assert goal(row, {"type": "nan_batch", "step": 10, "steps": 2}, 10, None, 5.5)[0]
    # a rollback at 15 to 10: steps 11..15 redone
    rb = lines((0, 1, 15, 0.0, {15})) + [(0, s, 15.0 + (s - 10), 1) for s in range(11, 21)]
    ev = [{"event": "instant_burst", "time": 14.2, "step": 15, "action": "rollback", "detail": {}},
          {"event": "rollback", "time": 14.3, "step": 15, "action": "rollback", "detail": {"to_step": 10}}]
    row = fault_cost({"type": "spike_batch", "step": 15}, rb, ev, 1.0)
    assert row["steps_lost"] == 6 and row["rollbacks"] == 1 and row["rung"] == "rollback->10"
    assert not goal(row, {"type": "spike_batch", "step": 15}, 10, None, 5.5)[0]  # (one step, not narrowed)


def test_a_killed_rank_costs_the_steps_since_the_checkpoint_and_the_restart():
    prog = lines((0, 1, 29, 0.0, set()), (1, 21, 40, 40.0, set()))   # killed at 30, resumed from 20, 11 s down
    row = fault_cost({"type": "kill_rank", "step": 30, "attempt": 0}, prog, [], 1.0)
    assert row["restarts"] == 1 and row["steps_lost"] == 9 and row["downtime_s"] == 12.0
    assert row["seconds_lost"] == 12.0 + 9 - 1  # the window (28.0 .. 49.0) less 2 clean steps
    never = fault_cost({"type": "kill_rank", "step": 30}, lines((0, 1, 29, 0.0, set())), [], 1.0)
    assert never["recovered"] is False and never["steps_lost"] is None
    assert fault_cost({"type": "hang_rank", "step": 50, "attempt": 1}, prog, [], 1.0) == \
        {"fault": "hang_rank", "step": 50, "steps": 1, "reached": False}


def test_progress_files_and_rungs(tmp_path):
    p = tmp_path / "progress.rank0.txt"
    p.write_text("0 1 10.0 1\n0 2 10.5 1\n0 3 11.0 0\n1 3 2")  # a torn last line (a killed writer)
    rows = read_progress(p)
    assert rows == [(0, 1, 10.0, 1), (0, 2, 10.5, 1), (0, 3, 11.0, 0)] and step_time(rows) == 0.5
    assert read_progress(tmp_path / "missing") == []
    assert _rung([{"event": "restart", "detail": {"resumed_at_step": 70}, "step": 71},
                  {"event": "precision_fallback", "action": "bf16_fallback", "detail": {}}]) == "restart->70, bf16"


def test_the_tiers_cost_in_the_step_times():
    # 100 steps of 20 ms; a snapshot every 10 steps slows the step after it by 6 ms and the next by 2; a disk
    # checkpoint every 50 slows the step after it by 30 ms (the disk's, not the tier's)
    times, clock = [], 0.0
    for step in range(1, 101):
        clock += 0.020 + (0.006 if step % 10 == 1 and step > 1 else 0.002 if step % 10 == 2 and step > 2 else 0) \
            + (0.030 if step in (51,) else 0)
        times.append((0, step, clock, 1))
    snaps = [s for s in range(10, 100, 10) if s != 50]
    per_snapshot, share = tier_cost(times, snaps, disk_every=50)
    assert abs(per_snapshot - 0.008) < 1e-6 and 0.03 < share < 0.04  # 8 ms each (the steps after 50 are the disk's)
    assert tier_cost(times, [], 50) is None


def test_the_demo_summary_shows_a_run_that_died_instead_of_crashing():
    """Issue 33: with fp16 and a high LR, plain DeepSpeed dies ("Current loss scale already at minimum") and its
    result has no counters; the demo's summary crashed on it (KeyError 'skipped_steps') -- the one outcome the
    demo exists to show."""
    from trainguard.demo.run import summarise

    died = {"rank": 0, "plain": True, "losses": [], "aborted": None, "global_steps": 75,
            "died": "Exception: Current loss scale already at minimum - cannot decrease scale anymore."}
    s = summarise([died, dict(died, rank=1)])
    assert s == {"completed": False, "steps": 75, "died": died["died"]}


def test_the_drills_verdict_is_the_per_fault_goals_the_loss_and_plains_outcome_not_goodput():
    """Issue 36 item 5: the drill failed its run on "goodput over the in-process faults >= 0.97", a goal restated
    as per-fault costs (goodput is their sum): a run with every fault within its goal was told trainguard failed."""
    from trainguard.drill import verdict

    rows = [{"run": "clean (no faults)", "completed": True},
            {"run": "trainguard", "completed": True, "loss_vs_clean": 0.0004, "goodput_in_process": 0.91},
            {"run": "plain DeepSpeed", "completed": False}]
    costs = [{"run": "trainguard", "fault": "nan_loss", "step": 100, "goal_met": True},
             {"run": "trainguard", "fault": "kill_rank", "step": 300, "goal_met": True},
             {"run": "trainguard", "fault": "lr_ramp", "step": 500, "goal_met": None},  # (not measurable here)
             {"run": "plain DeepSpeed", "fault": "nan_loss", "step": 100}]
    ok, lines = verdict(rows, costs)
    assert ok, lines
    assert not any("goodput" in line for line in lines) and "2 of 2" in " ".join(lines)
    costs[1]["goal_met"] = False
    ok, lines = verdict(rows, costs)
    assert not ok and "missed: kill_rank@300" in " ".join(lines)
    ok, _ = verdict(rows, [])  # (no fault judged: no verdict of success)
    assert not ok


def test_a_step_is_counted_in_one_row_only_a_kill_that_met_a_corrupted_checkpoint():
    """Issue 36 item 1: the corrupted checkpoint's 10 steps were counted in its own row and again inside the kill's
    (the rows added up to more than the run lost). The kill's row now holds its own loss; the corruption's, its."""
    # a kill at the start of step 23, the restart passing over the corrupted disk checkpoint of 20 to the one of 10
    progress = lines((0, 1, 22, 0.0, set()), (1, 11, 30, 40.0, set()))
    events = [{"event": "fault_injected", "time": 20.5, "step": 21,
               "detail": {"faults": [{"type": "corrupt_checkpoint", "step": 21}]}},
              {"event": "restart", "time": 39.0, "step": 10, "detail": {"attempt": 1, "downtime_s": 3.0}},
              {"event": "checkpoint_invalid", "time": 39.5, "step": 10, "detail": {"tag": "step00000020"}},
              {"event": "resume", "time": 39.6, "step": 10, "detail": {"step": 10, "tag": "step00000010"}}]
    kill = fault_cost({"type": "kill_rank", "step": 23, "rank": 1}, progress, events, 1.0)
    corrupt = fault_cost({"type": "corrupt_checkpoint", "step": 21}, progress, events, 1.0)
    assert corrupt["steps_lost"] == 10 and kill["corruption_steps"] == 10
    # executed: 22 (first attempt) + 20 (11..30) = 42 steps for 30; lost 12 in all: 2 the kill's, 10 the corruption's
    assert kill["steps_lost"] == 2 and kill["steps_lost"] + corrupt["steps_lost"] == 12, (kill, corrupt)
    assert goal(kill, {"type": "kill_rank", "step": 23}, 5, 2.0, 5.5)[0] is not None
