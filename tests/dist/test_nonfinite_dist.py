"""2 ranks under torchrun, real DeepSpeed engines on gloo: a NaN on one rank is named and the step
is skipped on every rank together, at every ZeRO stage and precision."""
import pytest

from tests.dist.conftest import make_config
from trainguard.data.position import ShardedSampler

pytestmark = pytest.mark.dist

STEPS = 16
FAULTS = [{"type": "nan_loss", "step": 5, "rank": 0}, {"type": "nan_loss", "step": 12, "rank": 1}]


def nonfinite_events(run):
    return [e for e in run.events if e["event"] == "nonfinite"]


def assert_sample_ids_match_rank_log(run, event, rank):
    """The ids the event names are the ids rank `rank` itself recorded for that step."""
    mine = [x for x in run.rank_lines(rank) if x["type"] == "metric" and x["step"] == event["step"]]
    assert len(mine) == 1
    named = event["detail"]["per_rank"][str(rank)]["sample_ids"]
    assert named and named == mine[0]["sample_ids"]


# every ZeRO stage in CI, with fp32 and bf16 alternating (fp16 at every stage: test_fp16_nan_skipped_with_cpu_switch);
# the other four of the 4 x 2 matrix are long (-m long), ~7 s each: the guard's code is the same for both dtypes
@pytest.mark.parametrize("stage, dtype", [
    pytest.param(stage, dtype, marks=() if (stage % 2 == 0) == (dtype == "fp32") else pytest.mark.long)
    for stage in (0, 1, 2, 3) for dtype in ("fp32", "bf16")])
def test_nan_on_each_rank_is_named_and_skipped_everywhere(tmp_path, torchrun, stage, dtype):
    cfg = make_config(tmp_path, faults=FAULTS)
    run = torchrun(cfg, STEPS, "--zero-stage", str(stage), "--dtype", dtype).ok()
    r0, r1 = run.results

    # the run completed, on both ranks, with finite and identical weights
    assert r0["global_steps"] == r1["global_steps"] == STEPS
    assert r0["aborted"] is None and r1["aborted"] is None
    assert r0["weights_finite"] and r1["weights_finite"]
    assert r0["param_sha256"] == r1["param_sha256"]
    # both ranks skipped the same two steps, and DeepSpeed counted them
    assert r0["skipped_steps"] == r1["skipped_steps"] == 2
    assert r0["guard_skipped_steps"] == r1["guard_skipped_steps"] == 2
    skipped = {0: [], 1: []}
    for rank in (0, 1):
        for line in run.rank_lines(rank):
            if line["type"] == "metric" and not line["applied"]:
                skipped[rank].append(line["step"])
    assert skipped[0] == skipped[1] == [5, 12]

    # one event per fault, naming the culprit rank (and only it), its coordinates and samples
    events = nonfinite_events(run)
    assert [(e["step"], e["ranks"], e["action"]) for e in events] == [(5, [0], "skip_step"), (12, [1], "skip_step")]
    for e, rank in zip(events, (0, 1)):
        d = e["detail"]["per_rank"][str(rank)]
        assert d["origin"] == "loss"
        assert d["coords"]["dp"] == rank
        assert_sample_ids_match_rank_log(run, e, rank)

    # the steps around the faults were applied and their losses are finite
    applied = [m for m in run.metrics if m["applied"]]
    assert len(applied) == STEPS - 2
    assert all(m["loss"] is not None for m in applied)


# (ZeRO-1 and ZeRO-2 are long: ZeRO-1's fp16 optimizer is ZeRO-2's class, and the recovery tests' fp16 ladders run
# ZeRO-2 fp16)
@pytest.mark.parametrize("stage", [0, pytest.param(1, marks=pytest.mark.long), pytest.param(2, marks=pytest.mark.long), 3])
def test_fp16_nan_skipped_with_cpu_switch(tmp_path, torchrun, stage):
    """fp16 with DeepSpeed's dynamic loss scaler (enabled on CPU by the test switch of PLATFORM.md)."""
    cfg = make_config(tmp_path, faults=FAULTS)
    run = torchrun(cfg, STEPS, "--zero-stage", str(stage), "--dtype", "fp16").ok()
    r0, r1 = run.results
    assert r0["weights_finite"] and r1["weights_finite"]
    assert r0["param_sha256"] == r1["param_sha256"]
    assert r0["skipped_steps"] == r1["skipped_steps"] >= 2
    events = nonfinite_events(run)
    assert (5, [0]) in [(e["step"], e["ranks"]) for e in events]
    assert (12, [1]) in [(e["step"], e["ranks"]) for e in events]
    assert all(m["loss_scale"] > 1 for m in run.metrics)
    # the scaler's floor is in every line (Prometheus's TrainguardLossScaleAtFloor compares the two)
    assert all(m["loss_scale_min"] is not None and 0 < m["loss_scale_min"] < m["loss_scale"] for m in run.metrics)


@pytest.mark.smoke("skip")
def test_acceptance_nan_loss_rank1_step20(tmp_path, torchrun):
    """The issue's 'done when': nan_loss on rank 1 at step 20 -> one event naming rank 1, step 20
    and that batch's sample ids; skipped_steps equal on both ranks; final weights finite."""
    batch = 4
    cfg = make_config(tmp_path, faults=[{"type": "nan_loss", "step": 20, "rank": 1}], bf16={"enabled": True})
    run = torchrun(cfg, 30).ok()
    events = nonfinite_events(run)
    assert len(events) == 1
    (e,) = events
    assert e["step"] == 20 and e["ranks"] == [1] and e["action"] == "skip_step"
    # rank 1's 20th micro-batch of epoch 0, computed independently from the sampler definition
    expected = ShardedSampler(4096, rank=1, world=2, shuffle=True, seed=0).indices(0)[19 * batch:20 * batch]
    assert e["detail"]["per_rank"]["1"]["sample_ids"] == expected
    assert e["detail"]["per_rank"]["1"]["position"] == {"epoch": 0, "batch_in_epoch": 20,
                                                        "consumed_samples": 20 * batch * 2}
    r0, r1 = run.results
    assert r0["skipped_steps"] == r1["skipped_steps"] == 1
    assert r0["weights_finite"] and r1["weights_finite"]
    for key in ("time", "step", "event", "ranks", "action", "detail"):
        assert all(key in ev for ev in run.events)
    for key in ("step", "loss", "grad_norm", "lr", "loss_scale", "skipped_steps"):
        assert all(key in m for m in run.metrics)


# the local-gradient check where DeepSpeed reduces (issue 52): ZeRO-0 every gradient at the boundary, ZeRO-1/2 each
# bucket (ZeRO-2: every micro-batch's, 4 of them a step here), ZeRO-3 a tensor hook a parameter
@pytest.mark.parametrize("stage, at, gas", [(0, "_reduce_non_expert_gradients", 1), (1, "average_tensor", 1),
                                            (2, "average_tensor", 4), (3, None, 1)])
def test_inf_grad_and_nan_batch_are_attributed(tmp_path, torchrun, stage, at, gas):
    faults = [{"type": "inf_grad", "step": 3, "rank": 1, "param": "blocks.1.mlp.0.weight"},
              {"type": "nan_batch", "step": 7, "rank": 0}]
    cfg = make_config(tmp_path, faults=faults, zero_optimization={"stage": stage}, gradient_accumulation_steps=gas)
    run = torchrun(cfg, 10).ok()
    (start,) = [e for e in run.events if e["event"] == "run_start"]
    point = start["detail"]["grad_check_point"]
    assert (f".{at}" in point and "multi-tensor" in point) if at else "a tensor hook a parameter" in point, point
    # every healthy step checked each rank's local gradients, and their norms are the global one's scale (the
    # divisor right: the global norm of the ranks' mean is at most the larger local one, and not far below it)
    healthy = {m["step"]: m["grad_norm"] for m in run.metrics if m["applied"] and m["step"] not in (3, 7)}
    for step, norm in healthy.items():
        local = [x["local_grad_norm"] for r in (0, 1) for x in run.rank_lines(r) if x["type"] == "metric"
                 and x["step"] == step]
        assert len(local) == 2 and all(v is not None for v in local), (step, local)
        assert 0.25 * sum(local) / 2 <= norm <= max(local) * 1.01, (step, norm, local)
    events = {e["step"]: e for e in nonfinite_events(run)}
    assert sorted(events) == [3, 7]
    assert events[3]["ranks"] == [1]
    assert events[3]["detail"]["per_rank"]["1"]["origin"] == "gradients"   # loss was finite
    assert events[7]["ranks"] == [0]
    assert events[7]["detail"]["per_rank"]["0"]["origin"] == "loss"        # poisoned embedding output
    injected = [(e["step"], e["ranks"], e["detail"]["faults"][0]["type"]) for e in run.events
                if e["event"] == "fault_injected"]
    assert injected == [(3, [1], "inf_grad"), (7, [0], "nan_batch")]
    assert all(r["weights_finite"] and r["skipped_steps"] == 2 for r in run.results)


def test_zero0_fp32_plain_deepspeed_corrupts_weights_guard_does_not(tmp_path, torchrun):
    """The case DeepSpeed does not protect: ZeRO-0 fp32 with a torch optimizer applies the NaN."""
    cfg = make_config(tmp_path, faults=[{"type": "nan_loss", "step": 4, "rank": 1}],
                      zero_optimization={"stage": 0})
    plain = torchrun(cfg, 8, "--plain", out_name="plain").ok()
    guarded = torchrun(cfg, 8, out_name="guarded").ok()
    assert not any(r["weights_finite"] for r in plain.results)
    assert all(r["skipped_steps"] == 0 for r in plain.results)
    assert all(r["weights_finite"] for r in guarded.results)
    assert all(r["skipped_steps"] == 1 for r in guarded.results)


def test_guard_costs_nothing_when_all_is_well(tmp_path, torchrun):
    """No fault: the guarded run ends bit-identical to plain DeepSpeed (same loader order, same
    steps); and with "enabled": false, ds_plugins.initialize *is* deepspeed.initialize."""
    cfg = make_config(tmp_path, bf16={"enabled": True})
    plain = torchrun(cfg, 12, "--plain", out_name="plain").ok()
    guarded = torchrun(cfg, 12, out_name="guarded").ok()
    assert guarded.results[0]["engine_class"] == "TrainguardDeepSpeedEngine"
    assert plain.results[0]["engine_class"] == "DeepSpeedEngine"
    assert guarded.results[0]["param_sha256"] == plain.results[0]["param_sha256"]
    assert guarded.results[0]["losses"] == plain.results[0]["losses"]
    # nothing happened but the start-of-run warnings (this config has no LR warmup)
    assert [e["event"] for e in guarded.events if e["event"] not in ("run_start", "run_end")] == ["no_warmup"]

    off = make_config(tmp_path, block={"enabled": False}, bf16={"enabled": True})
    disabled = torchrun(off, 12, out_name="disabled").ok()
    assert disabled.results[0]["engine_class"] == "DeepSpeedEngine"
    assert disabled.results[0]["sample_ids_known"] is False
    assert disabled.results[0]["param_sha256"] == plain.results[0]["param_sha256"]


# (ZeRO-0 fp32 is long: the guard's micro-batch count is the same at every stage)
@pytest.mark.parametrize("stage, dtype", [pytest.param(0, "fp32", marks=pytest.mark.long), (2, "bf16")])
def test_gradient_accumulation_counts_micro_batches(tmp_path, torchrun, stage, dtype):
    """With 2 micro-batches per step the fault poisons both of rank 1's; the step is still skipped
    once, on both ranks, and the event lists the samples of both micro-batches."""
    cfg = make_config(tmp_path, faults=[{"type": "nan_loss", "step": 5, "rank": 1}], gradient_accumulation_steps=2)
    run = torchrun(cfg, 8, "--zero-stage", str(stage), "--dtype", dtype).ok()
    (e,) = nonfinite_events(run)
    d = e["detail"]["per_rank"]["1"]
    assert e["step"] == 5 and e["ranks"] == [1]
    assert d["micro_batches"] == 2 and d["nonfinite_micro_batches"] == 2
    assert len(d["sample_ids"]) == 2 * 4
    assert_sample_ids_match_rank_log(run, e, 1)
    assert all(r["skipped_steps"] == 1 and r["global_steps"] == 8 and r["weights_finite"] for r in run.results)


def test_abort_action_stops_every_rank_with_a_report(tmp_path, torchrun):
    cfg = make_config(tmp_path, faults=[{"type": "nan_loss", "step": 6, "rank": 1}],
                      block={"detectors": {"nonfinite": {"action": "abort"}}})
    run = torchrun(cfg, 12).ok()
    for r in run.results:
        assert r["aborted"] is not None, r
        report = r["aborted"]["report"]
        assert report["step"] == 6 and report["verdicts"][0]["ranks"] == [1]
        assert report["coords"]["1"]["dp"] == 1 and report["samples"]["1"]["sample_ids"]
        # steps 1-5 applied, step 6 not (decided at its update's launch, DeepSpeed's own skip of a non-finite gradient
        # may have counted it first: trainguard.step.launchgate), nothing after the abort
        assert r["global_steps"] - r["skipped_steps"] == 5 and r["global_steps"] <= 6 and r["weights_finite"], r
    assert [e["step"] for e in run.events if e["event"] == "abort"] == [6]
