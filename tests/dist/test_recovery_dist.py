"""Recovery under torchrun with real DeepSpeed engines: ladders, in-process rollback to the last
stable checkpoint, data skipped past the bad batches, quarantine of the culprit rank's samples,
lowered LR, suspect_rank, and ABORT when the budget is spent."""
from pathlib import Path

import pytest

from tests.dist.conftest import make_config
from trainguard.metrics.jsonl import read

pytestmark = pytest.mark.dist


def block(tmp_path, **recovery):
    return {"metrics": {"per_rank": True},
            "checkpoint": {"dir": str(tmp_path / "ck"), "every_steps": 10, "stable_after": 5, "verify_steps": 2},
            "recovery": {"skip_batches": 5, **recovery}}


def events(run, name):
    return [e for e in run.events if e["event"] == name]


@pytest.mark.smoke("rollback")
def test_nonfinite_ladder_rolls_back_and_never_replays_a_quarantined_sample(tmp_path, torchrun):
    faults = [{"type": "nan_loss", "step": s, "rank": 1} for s in (22, 24, 26)]
    # the ladder as written (replay_check off: by default a replay would find the weights healthy and skip)
    cfg = make_config(tmp_path, block=block(tmp_path, reset_optimizer_moments=True, replay_check=False), faults=faults,
                      bf16={"enabled": True})
    run = torchrun(cfg, 40).ok()
    # the ladder: skip, skip, then (3 within 100 steps) roll back
    assert [(e["step"], e["action"]) for e in events(run, "nonfinite")] == [(22, "skip_step"), (24, "skip_step"),
                                                                            (26, "rollback")]
    (rb,) = events(run, "rollback")
    d = rb["detail"]
    # the newest *stable* checkpoint from before the onset (22): 20 was spoiled by the NaN at 22
    assert d["to_tag"] == "step00000010" and d["onset_step"] == 22 and d["to_step"] == 10
    assert d["abandoned"] == ["step00000020"]
    # reset_optimizer_moments: Adam's two moments of rank 0's fp32 partition (ZeRO-2: half of the model's
    # ~350k parameters) were found in DeepSpeed's inner optimizer and zeroed
    assert d["optimizer_moments_reset"] is True and 300_000 < d["moments_zeroed"] < 400_000
    # dirty-data isolation: only rank 1's samples of the bad steps are quarantined
    bad_ids = [i for e in events(run, "nonfinite") for i in e["detail"]["per_rank"]["1"]["sample_ids"]]
    assert list(d["quarantined"]) == ["1"] and sorted(d["quarantined"]["1"]) == sorted(bad_ids[-4:])
    # the data position moved past what was seen (26 batches) plus skip_batches (5)
    assert d["position_after"]["batch_in_epoch"] == 31
    quarantined = set(d["quarantined"]["1"])
    for rank in (0, 1):
        after = [x for x in run.rank_lines(rank) if x["type"] == "metric" and x["position"]["batch_in_epoch"] > 26]
        assert after and min(x["position"]["batch_in_epoch"] for x in after) == 32  # 27..31 never read
        assert not quarantined & {i for x in after for i in x["sample_ids"]}
    # the faults stood for bad batches: they do not come back when steps 23..26 are re-run
    assert len(events(run, "fault_injected")) == 3
    # one rank, three times, on different data: suspect it
    (sus,) = events(run, "suspect_rank")
    assert sus["ranks"] == [1] and sus["detail"]["coords"]["dp"] == 1 and sus["detail"]["occurrences"] == [22, 24, 26]
    import json
    from pathlib import Path

    excluded = json.loads(Path(sus["detail"]["file"]).read_text())  # what a launcher excludes on restart
    assert excluded["ranks"] == [1] and excluded["hosts"] == [sus["detail"]["host"]]
    assert all(r["global_steps"] == 40 and r["weights_finite"] for r in run.results)
    assert run.results[0]["param_sha256"] == run.results[1]["param_sha256"]


def test_bad_data_is_skipped_without_a_rollback_and_damaged_weights_roll_back_at_once(tmp_path, torchrun):
    """The default (recovery.replay_check): a burst of four batches on rank 1, each with one NaN sample
    (row 2), costs four skipped steps and no rollback -- the last healthy micro-batch replays healthy on
    the weights, and a per-sample replay names and quarantines the one bad sample of each batch, not
    its batch. Then NaN written into rank 0's weights (memory corruption): the replay is no longer
    healthy, so it rolls back at the first occurrence (a skip would not help), quarantining nothing."""
    faults = [{"type": "nan_batch", "step": 22, "rank": 1, "steps": 4, "sample": 2},
              {"type": "nan_weights", "step": 34, "rank": 0, "param": "blocks.1.mlp.0.weight"}]
    cfg = make_config(tmp_path, block=block(tmp_path, ladder_window=5), faults=faults,
                      train_micro_batch_size_per_gpu=8)
    run = torchrun(cfg, 45).ok()
    nf = events(run, "nonfinite")
    burst = [e for e in nf if e["step"] < 30]
    assert [(e["step"], e["action"], e["ranks"]) for e in burst] == [(s, "skip_step", [1]) for s in (22, 23, 24, 25)]
    bad = []
    for e in burst:
        d = e["detail"]["per_rank"]["1"]
        assert len(d["batch_sample_ids"]) == 8 and d["sample_ids"] == [d["batch_sample_ids"][2]], d
        assert d["narrowed"]["rows"] == 8 and e["detail"]["weights"]["verdict"] == "healthy"
        bad += d["sample_ids"]
    # the ladder would have rolled back at the 3rd and 4th (within ladder_window=5); the replay said no
    assert "the data was bad" in burst[2]["detail"]["reason"]
    (rb,) = events(run, "rollback")
    d = rb["detail"]
    assert rb["step"] == 34 and d["anomaly"] == "nonfinite" and "damaged" in d["reason"]
    (hit,) = [e for e in nf if e["step"] == 34]
    assert hit["detail"]["weights"]["verdict"] == "damaged" and hit["ranks"] == [0]
    assert d["quarantined"] == {}  # the weights, not the data: nothing set aside
    # the newest stable checkpoint before 34: 20 (the skipped burst did not spoil it), not 30 (too recent)
    assert d["to_step"] == 20
    # only the four bad samples were quarantined (the ranks' loader state in the checkpoints)
    from trainguard.checkpoint.diff import diff

    ck = tmp_path / "ck"
    assert diff(ck / "step00000020", ck / "step00000040")["quarantine_added"] == sorted(bad)
    assert len(events(run, "fault_injected")) == 5
    assert all(r["global_steps"] == 45 and r["weights_finite"] for r in run.results)
    assert run.results[0]["param_sha256"] == run.results[1]["param_sha256"]


def test_instant_burst_rolls_back_and_slow_rise_lowers_the_lr(tmp_path, torchrun):
    faults = [{"type": "spike_batch", "step": 27, "rank": 0},
              {"type": "lr_ramp", "step": 33, "steps": 60, "factor": 1.2}]
    # (replay_check off: the instant_burst rung as written; by default the burst would be skipped, test above)
    # (lr_cut "factor": the ramp fault stops at the rollback, so a cut sized by the faulted LR -- recovery.lr_cut's
    # default, tests/unit/test_lrcut.py -- would be measured against an LR the schedule no longer gives)
    cfg = make_config(tmp_path, block=block(tmp_path, lr_factor=0.5, lr_cooldown_steps=200, max_rollbacks=10,
                                            replay_check=False, lr_cut="factor"), faults=faults)
    run = torchrun(cfg, 80).ok()
    rbs = events(run, "rollback")
    assert rbs[0]["detail"]["anomaly"] == "instant_burst" and rbs[0]["step"] == 27
    assert rbs[0]["detail"]["lr_factor"] is None and rbs[0]["detail"]["quarantined"].keys() == {"0"}
    lowered = [r for r in rbs if r["detail"]["anomaly"] == "slow_rise"]
    assert lowered and lowered[0]["detail"]["lr_factor"] == 0.5
    # the checkpoint predates where the creep began, not only where it was detected
    assert lowered[0]["detail"]["to_step"] < lowered[0]["detail"]["onset_step"] <= lowered[0]["step"] - 12
    # after that rollback (until the next one, if any), the updates used half the LR: the ramp
    # fault stands for a bad schedule, which the recovery's LR reduction overrides
    t0 = lowered[0]["time"]
    t1 = min([e["time"] for e in run.events if e["event"] in ("rollback", "abort") and e["time"] > t0] + [1e12])
    lrs = {m["lr"] for m in run.metrics if t0 < m["time"] < t1 and m["applied"]}
    assert lrs and all(abs(lr - 0.0015) < 1e-9 for lr in lrs), lrs
    assert all(r["weights_finite"] for r in run.results)


def test_rollback_budget_exhausted_aborts_with_a_report(tmp_path, torchrun):
    faults = [{"type": "spike_batch", "step": 27, "rank": 1}, {"type": "spike_batch", "step": 31, "rank": 1}]
    cfg = make_config(tmp_path, block=block(tmp_path, max_rollbacks=1, replay_check=False, when_exhausted="abort"),
                      faults=faults)
    run = torchrun(cfg, 45).ok()
    assert len(events(run, "rollback")) == 1
    for r in run.results:
        rep = r["aborted"]["report"]
        assert "rollback budget exhausted" in rep["reason"]
        assert rep["verdicts"] and 1 in rep["verdicts"][0]["ranks"]
        assert rep["coords"]["1"]["dp"] == 1 and rep["samples"]["1"]["sample_ids"]
        assert rep["tried"]["rollbacks"][0]["anomaly"] == "instant_burst"
    assert [e["event"] for e in run.events if e["event"] == "abort"] == ["abort"]


def test_no_checkpoint_means_skip_not_crash(tmp_path, torchrun):
    cfg = make_config(tmp_path, block={"recovery": {"skip_batches": 3, "replay_check": False}},
                      faults=[{"type": "spike_batch", "step": 25, "rank": 1}])
    run = torchrun(cfg, 30).ok()
    (u,) = events(run, "rollback_unavailable")
    assert u["step"] == 25 and "checkpoint" in u["detail"]["reason"]
    assert all(r["skipped_steps"] == 1 and r["global_steps"] == 30 for r in run.results)


FP16_COLLAPSE = [{"type": "fp16_overflow", "step": 25, "rank": 1, "steps": 40}]
THREE_RUNGS = ["rollback", "raise_floor", "bf16_fallback"]  # (the default goes to bf16 at once)


@pytest.mark.long  # (~11 s: the failure trainguard exists for, in plain DeepSpeed; the ladder tests show the guard's side)
def test_fp16_scale_collapse_kills_plain_deepspeed(tmp_path, torchrun):
    """The baseline the next test improves on: DeepSpeed alone stops at the minimum loss scale."""
    cfg = make_config(tmp_path, faults=FP16_COLLAPSE)
    run = torchrun(cfg, 60, "--dtype", "fp16", "--plain")
    assert run.rc != 0
    assert "Current loss scale already at minimum" in (run.out / "torchrun.log").read_text()


def test_fp16_scale_collapse_ladder_ends_in_bf16_and_finishes(tmp_path, torchrun):
    """Overflow after overflow on rank 1 in fp16 (a model beyond fp16's range), with the three-rung
    loss_scale ladder: it rolls back and resets the scale, then also raises the floor, then re-creates
    the engine in bf16 with the optimizer state carried over -- and the run finishes, where DeepSpeed
    alone stops. (The default ladder goes to bf16 at once: the next test.)"""
    cfg = make_config(tmp_path, block=block(tmp_path, ladders={"loss_scale": THREE_RUNGS}), faults=FP16_COLLAPSE)
    run = torchrun(cfg, 60, "--dtype", "fp16").ok()
    scale = events(run, "loss_scale")
    assert [e["action"] for e in scale] == ["rollback", "rollback", "rollback"]
    assert all(e["detail"]["at_floor"] and e["detail"]["onset_step"] == 25 for e in scale)
    rbs = events(run, "rollback")
    assert [r["detail"]["anomaly"] for r in rbs] == ["loss_scale"] * 3
    assert all(r["detail"]["to_tag"] == "step00000020" and r["detail"]["skip_batches"] == 0 for r in rbs)
    resets = events(run, "loss_scale_reset")
    assert [e["action"] for e in resets] == ["reset_scale", "raise_floor"]
    assert resets[1]["detail"]["min_scale_after"] == 16.0
    (fb,) = events(run, "precision_fallback")
    assert fb["detail"]["to"] == "bf16" and fb["detail"]["optimizer_state"] == "carried"
    # no overflow after the switch: bf16 has fp32's range
    lines = read(run.out / "trainguard.jsonl")
    # (the metric line of the step that decided it is written one step late, after the event)
    after = [m for m in lines[lines.index(fb) + 1:] if m["type"] == "metric"]
    assert after[0]["step"] == fb["step"] and not after[0]["applied"]
    after = after[1:]
    assert [m["step"] for m in after] == list(range(21, 61))
    assert all(m["applied"] and m["loss_scale"] == 1.0 for m in after)
    for r in run.results:
        assert r["global_steps"] == 60 and r["weights_finite"] and r["aborted"] is None
        assert r["engine_class"].startswith("Trainguard")
    assert run.results[0]["param_sha256"] == run.results[1]["param_sha256"]
    clean = torchrun(make_config(tmp_path, block=block(tmp_path / "clean")), 60, "--dtype", "bf16",
                     out_name="clean").ok()
    # the loss ends where a clean bf16 run ends (the rolled-back steps were re-trained in bf16)
    got, want = run.results[0]["eval_loss"], clean.results[0]["eval_loss"]
    assert abs(got - want) / want < 0.05


# (ZeRO-1 re-creates the same optimizer class as ZeRO-2, the test above; it passed here too and is left out
# for the suite's time)
@pytest.mark.parametrize("stage", [0, 3])
def test_default_ladder_goes_to_bf16_at_once_at_zero_0_and_aborts_at_zero_3(tmp_path, torchrun, stage):
    """The default loss_scale ladder goes to bf16 at once (issue 16: overflows persisting at the minimum
    scale are values beyond fp16's range; a scale reset cannot help): one rollback, no scale reset, then
    bf16 -- at the ZeRO stages the tests above do not cover. ZeRO-0: the engine is re-created in bf16
    (FP16_Optimizer -> BF16 optimizer) and the run finishes, both replicas identical. ZeRO-3 partitions the
    parameters into the fp16 engine, which cannot be re-created in place: the run stops with a report
    that says so and what to do (restart in bf16 from the checkpoint), instead of DeepSpeed's crash."""
    cfg = make_config(tmp_path, block=block(tmp_path), faults=FP16_COLLAPSE, zero_optimization={"stage": stage})
    run = torchrun(cfg, 50, "--dtype", "fp16")
    if stage == 3:
        run.ok()  # (the demo worker catches TrainguardAbort and reports it)
        assert all(r["aborted"] and r["global_steps"] == 20 for r in run.results)  # at the rolled-back state
        (ab,) = events(run, "abort")
        assert "ZeRO-3" in ab["detail"]["reason"] and "bf16" in ab["detail"]["reason"]
        assert not events(run, "precision_fallback")
        return
    run.ok()
    (fb,) = events(run, "precision_fallback")
    assert fb["detail"]["to"] == "bf16" and fb["detail"]["zero_stage"] == stage
    # straight there: one collapse, one rollback, no scale reset or floor raise
    assert len(events(run, "loss_scale")) == 1 and len(events(run, "rollback")) == 1
    assert not events(run, "loss_scale_reset")
    for r in run.results:
        assert r["global_steps"] == 50 and r["weights_finite"] and r["aborted"] is None
    assert run.results[0]["param_sha256"] == run.results[1]["param_sha256"]
    after = [m for m in run.metrics if m["time"] > fb["time"] and m["step"] > fb["step"]]
    assert after and all(m["applied"] and m["loss_scale"] == 1.0 for m in after)


@pytest.mark.parametrize("stage", [0, pytest.param(1, marks=pytest.mark.long), pytest.param(2, marks=pytest.mark.long),
                                   3])  # (ZeRO-1 and -2: -m long, CI's time; 0 and 3 bound them)
def test_fp16_whose_first_steps_were_skipped_restarts_from_its_first_step_and_lives(tmp_path, torchrun, stage):
    """The shape of issue 50's Megatron-LM run on DeepSpeed: fp16 whose first steps overflow (the
    first step's checkpoint is written before any update was applied), then updates, then a restart to that first
    step's checkpoint (forced at 12), at every ZeRO stage: the run reaches its last step with finite weights, the
    same on both ranks, and nothing failed to load."""
    fp16 = {"fp16": {"enabled": True, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 1,
                     "min_loss_scale": 1}}
    cfg = make_config(tmp_path, block={"checkpoint": {"dir": str(tmp_path / "ck"), "every_steps": 5}},
                      faults=[{"type": "fp16_overflow", "step": 1, "steps": 3, "rank": 1},  # (the scale's search)
                              {"type": "force_action", "step": 12, "action": "restart"}],
                      zero_optimization={"stage": stage}, **fp16)
    run = torchrun(cfg, 20).ok()
    metrics = [m for m in run.metrics if m["step"] < 12]
    assert not metrics[0]["applied"] and metrics[-1]["applied"], [m["applied"] for m in metrics]
    (rb,) = events(run, "rollback")
    assert rb["step"] == 12 and rb["detail"]["to_step"] == 1 and "from_first_step" in rb["detail"]
    assert not events(run, "recovery_failed") and not events(run, "abort")
    assert all(r["global_steps"] == 20 and r["weights_finite"] for r in run.results)
    assert run.results[0]["param_sha256"] == run.results[1]["param_sha256"]


def _keeps_progress_on(rank: int, world: int, store: str, losses: list, out: str) -> None:
    """One rank of the test below: the no-room rule's agreement, over a real gloo group."""
    import json
    from types import SimpleNamespace

    import torch.distributed as dist

    from trainguard.decisions import Decision
    from trainguard.events import Action, Anomaly
    from trainguard.recovery.room import keeps_progress
    from trainguard.recovery.lrcut import LrHistory

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        history = LrHistory()
        history.last_step = 150  # (the run's length where its count goes on: Megatron-LM's --train-iters)
        # (the checkpointer's two parts the rule reads: the LR history and the losses its saves kept on this rank)
        cp = SimpleNamespace(lr_history=history, saver=SimpleNamespace(losses=losses[rank]))
        creep = Decision(Action.ROLLBACK, "a creep", lower_lr=True, lr_scale=0.5, onset_step=96,
                         anomaly=Anomaly.SLOW_RISE, loss=3.85)
        Path(out, f"rank{rank}.json").write_text(json.dumps(keeps_progress(cp, creep, 140, 50, None)))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("losses, refused", [([{50: 4.23}, {50: 4.23}], True), ([{50: 4.23}, {}], False)])
def test_every_rank_takes_the_same_no_room_decision_even_where_one_lacks_the_loss(tmp_path, losses, refused):
    """The Megatron-LM peers bench hung at TP=2 when rank 0 refused a creep's rollback (it knew the checkpoint's loss)
    and rank 1 went on to load (it did not): the refusal is and-ed over the ranks, so a rank that does not know the
    loss makes every rank take the rollback, and none waits in a collective the others never enter."""
    import json

    import torch.multiprocessing as mp

    mp.start_processes(_keeps_progress_on, args=(2, str(tmp_path / "store"), losses, str(tmp_path)), nprocs=2,
                       join=True, start_method="spawn")
    said = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert said[0] == said[1], said
    assert (said[0] is not None) is refused and (not refused or "the LR lowered in place" in said[0]), said
