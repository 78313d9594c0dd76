"""The fire drill (issues 5, 7, 15, 16): 2 ranks, ZeRO-2 fp16, a schedule of faults -- one NaN sample, a poisoned
burst, a corrupted newest checkpoint before a killed rank, an LR ramp, a hung rank, an fp16 collapse -- under
torchrun --max-restarts=2; trainguard against plain DeepSpeed and a fault-free run with the same seeds
and data.

The suite runs the **short drill**: the same schedule scaled to 200 steps (what is measured in steps
scales with it: the ladder window, the warmup, the ramp) on a small model, and checks every row of
it. The full 1,000-step drill is a benchmark (``python bench/fire_drill.py`` / ``trainguard drill``;
here with ``TRAINGUARD_DRILL=1``): ~8 minutes on 2 cores, and it holds the 2% loss goal."""
import io
import json
import os

import pytest

from trainguard.drill import drill

pytestmark = pytest.mark.dist


def check_costs(costs):
    """The per-fault table (issue 16): trainguard's cost of each fault, and the baseline's beside it."""
    tg = {(c["fault"], c["step"]): c for c in costs if c["run"] == "trainguard"}
    assert len(costs) == 2 * len(tg) == 14  # every fault of the schedule, in both runs
    one, burst = tg[("nan_batch", 30)], tg[("nan_batch", 60)]
    # one bad sample: 1 step lost, no rollback, that sample named (a per-sample replay narrowed its batch)
    assert one["steps_lost"] == 1 and one["rollbacks"] == 0 and one["narrowed"] and len(one["samples_named"]) == 1
    assert burst["steps_lost"] == 3 and burst["rollbacks"] == 0 and burst["rung"] == "skip_step x3"
    assert one["goal_met"] and burst["goal_met"]
    # the newest disk checkpoint (step 100, every 50) corrupted right after it was saved, then rank 1 killed: no
    # snapshot in memory is newer than it (the tier skips a step the disk saved), so the corruption costs what the
    # tier's interval bounds -- the restart passes over it (named) to the snapshot of step 90, 10 steps instead of
    # the disk's 50 (issue 25 item 11: on the old schedule a newer snapshot made its cost 0 by construction)
    corrupt, kill = tg[("corrupt_checkpoint", 100)], tg[("kill_rank", 102)]
    assert corrupt["met"] and corrupt["steps_lost"] == 10 and corrupt["goal_met"], corrupt
    # the kill itself: 2 steps past the disk's 100 (the 10 the corruption cost are that fault's row, not counted twice)
    assert kill["restarts"] == 1 and kill["recovered"] and "restart->90" in kill["rung"] and kill["goal_met"], kill
    assert kill["corruption_steps"] == 10 and kill["steps_lost"] <= 10, kill
    fp16 = tg[("fp16_overflow", 160)]
    assert fp16["restarts"] == 0 and "bf16" in fp16["rung"] and fp16["goal_met"], fp16
    hang = tg[("hang_rank", 144)]
    assert hang["named_ranks"] == [0] and hang["recovered"]
    # named within hang_timeout_s + interval_s (5.5 s: the goal); on a loaded 2-core machine the monitor thread's
    # wake-ups slip, so the suite allows twice that -- a watchdog that stopped naming hangs in time still fails
    assert hang["time_to_detect_s"] is not None and hang["time_to_detect_s"] <= 11.0, hang


def check_rows(rows, loss_within):
    by = {r["run"]: r for r in rows}
    clean, insured, tg, plain = (by[k] for k in ("clean (no faults)", "trainguard, no faults", "trainguard",
                                                 "plain DeepSpeed"))
    # with no fault, the guard changes nothing: the same final loss, to the last bit
    assert clean["completed"] and insured["completed"] and insured["eval_loss"] == clean["eval_loss"]
    # under the faults trainguard finishes, near the clean loss ...
    assert tg["completed"] and abs(tg["loss_vs_clean"]) <= loss_within, tg
    # ... every fault having had its effect: the bad data skipped without a rollback, fallen back from fp16
    # to bf16 (its one rollback), restarted after the killed rank (passing over the corrupted checkpoint,
    # which was named) and after the hung one (named: rank 0), resuming by itself each time
    assert "nonfinite" not in tg["rollback_anomalies"] and "loss_scale" in tg["rollback_anomalies"], tg
    assert tg["checkpoint_invalid"] >= 1 and tg["precision_fallback"], tg
    assert tg["restarts"] == 2 and tg["hangs_named"] == [0], tg
    # while DeepSpeed alone, run as a careful user runs it (its own checkpoints, resume and timeout), does
    # not finish: restarted after the killed rank it resumes from its checkpoint, but on the hung rank its
    # ZeRO groups (new_group, no timeout: 30 minutes) wait on past its own timeout -- or it stops at the
    # minimum loss scale; the row says which
    assert not plain["completed"] and plain["died"]
    # goodput is measured for every run (the 0.97 goal is not met at this fault density on CPU: issue 16's note).
    # Over 200 steps the two restarts dominate the wall time (0.177 measured, stop 21); what the guard controls
    # is the steps: 16 lost (stop 21) -- a regression past 30 fails (issue 25 item 11: the 0.1 bound alone
    # could not fail)
    assert 0.1 < tg["goodput"] < insured["goodput"] <= clean["goodput"] <= 1.0
    assert tg["steps_lost"] <= 30, tg
    # and over the in-process faults alone (the killed and hung ranks' windows taken out of the wall time)
    assert tg["goodput"] < tg["goodput_in_process"] <= 1.0 and tg["process_fault_s"] > 0


# long (2.5 minutes; its schedule's every fault has its own test in the suite): `python -m pytest -m long tests`
@pytest.mark.long
@pytest.mark.timeout(1300)  # (each of the 4 runs is bounded at 300 s; ~2 minutes in all on a quiet machine)
def test_short_fire_drill(tmp_path):
    """200 steps, every fault of the schedule, every row checked (5% loss tolerance: a 200-step run's
    final loss is noisier than a 1,000-step one's)."""
    out = io.StringIO()
    rc, rows = drill(200, tmp_path, extra=["--d-model", "48", "--layers", "2"], stream=out, timeout=300)
    print(out.getvalue())
    check_rows(rows, loss_within=0.05)
    saved = json.loads((tmp_path / "drill.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(rows)) and saved["steps"] == 200
    check_costs(saved["costs"])
    assert "cost per fault" in out.getvalue()


@pytest.mark.timeout(1800)
@pytest.mark.skipif(os.environ.get("TRAINGUARD_DRILL") != "1",
                    reason="the 1,000-step fire drill is a benchmark (bench/fire_drill.py): TRAINGUARD_DRILL=1 runs it")
def test_fire_drill(tmp_path):
    out = io.StringIO()
    rc, rows = drill(1000, tmp_path, stream=out)
    print(out.getvalue())
    check_rows(rows, loss_within=0.02)
    tg = {r["run"]: r for r in rows}["trainguard"]
    # (this used to read `assert rc == (0 if goodput >= 0.97 else 1)`: true whatever the goodput -- issue 25 item 11)
    costs = json.loads((tmp_path / "drill.json").read_text())["costs"]
    missed = [(c["fault"], c["step"], c.get("goal")) for c in costs if c["run"] == "trainguard" and c.get("goal_met") is False]
    assert not missed, missed  # every per-fault goal of issue 16 (measured: all met, stop 21)
    # goodput over the in-process faults: the 0.97 goal is blocked at this fault density (issue 16's note: the
    # per-fault goals themselves allow ~0.93); measured 0.936 -- a regression below 0.90 fails
    assert tg["goodput_in_process"] >= 0.90, tg
    assert rc == 0  # (the verdict: the per-fault goals, the loss and plain's outcome -- goodput printed, not judged)
