"""megatron-core under torchrun (issue 6): a tiny GPTModel with megatron's own DDP, optimizer and
pipeline schedules (tests/support/megatron_worker.py, CPU compatibility layer in tests/support),
guarded by megatron_hooks.install. 2 processes per layout: TP=2, PP=2, DP=2. The installed
megatron-core (0.19.2 in CI) runs every test; the tests taking ``megatron_core`` run on 0.17.1 and
0.16.1 too (installed beside it by scripts/setup.sh, put first on the workers' PYTHONPATH)."""
import argparse
import json
import sys
import os

import pytest

from tests.support.require import imported, unavailable

from tests.support import releases
from trainguard.demo.run import run_worker
from trainguard.metrics.jsonl import read

imported("megatron.core")
pytestmark = pytest.mark.dist

LAYOUTS = {"tp": ["--tp", "2"], "pp": ["--pp", "2"], "dp": []}
THREE_RUNGS = ["rollback", "raise_floor", "bf16_fallback"]  # (the default loss_scale ladder goes to bf16 at once)
# (layout, faulty rank) -> the fault, the coordinates it must be attributed to, the first bad module's
# global layer (None: no module produced it -- a loss or gradient fault)
CASES = {
    ("tp", 0): ({"type": "inf_activation", "module": "decoder.layers.1.mlp.linear_fc1"}, {"tp": 0}, 2),
    ("tp", 1): ({"type": "inf_activation", "module": "decoder.layers.0.self_attention.linear_qkv"}, {"tp": 1}, 1),
    ("pp", 0): ({"type": "inf_activation", "module": "decoder.layers.1.mlp.linear_fc1"}, {"pp": 0}, 2),
    ("pp", 1): ({"type": "inf_activation", "module": "decoder.layers.0.mlp.linear_fc1"}, {"pp": 1}, 3),
    ("dp", 0): ({"type": "inf_grad", "param": "decoder.layers.2.mlp.linear_fc2.weight"}, {"dp": 0}, None),
    ("dp", 1): ({"type": "nan_loss"}, {"dp": 1}, None),
}


@pytest.fixture(params=["0.19.2", "0.17.1", "0.16.1"])
def megatron_core(request, monkeypatch):
    """The megatron-core release the workers run (asserted from their run_start record): the installed
    one (0.19.2 in CI) or one that bash scripts/setup.sh test installs beside it, first on their PYTHONPATH."""
    try:
        path = releases.core_path(request.param)
    except LookupError as e:
        unavailable("megatron_releases", str(e))
    if path:
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (path, os.environ.get("PYTHONPATH")) if p))
    return request.param


def ran_on(lines, version):
    (start,) = [x for x in lines if x.get("event") == "run_start"]
    assert start["detail"]["megatron_core"].split("+")[0] == version  # (0.19's carries a git hash)
    # (issue 52: the local-gradient check where megatron's DDP reduces each bucket group, not a hook a parameter)
    assert "multi-tensor norm a call of _ParamAndGradBucketGroup.start_grad_sync" in start["detail"]["grad_check_point"]


def run(tmp_path, name, layout, steps, block=None, more=()):
    """Two ranks of tests/support/megatron_worker.py in ``tmp_path/name``, guarded by ``block``
    (written to ``name.json``; None: plain megatron); must finish. Returns (per-rank results,
    the run's trainguard.jsonl lines, [] when it wrote none)."""
    cfg = None
    if block is not None:
        cfg = tmp_path / f"{name}.json"
        cfg.write_text(json.dumps(block))
    out = tmp_path / name
    rc, results = run_worker(cfg, out, steps, extra=LAYOUTS[layout] + list(more) + ([] if cfg else ["--no-guard"]),
                             module="tests.support.megatron_worker", timeout=300)
    log = (out / "torchrun.log").read_text()[-3000:] if (out / "torchrun.log").exists() else ""
    assert rc == 0 and all(results), log
    jsonl = out / "trainguard.jsonl"
    return results, (read(jsonl) if jsonl.exists() else [])


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_nan_at_each_coordinate_is_attributed_to_it(tmp_path, layout, megatron_core):
    """One run per layout: a fault on rank 0 at step 3, one on rank 1 at step 5. (megatron-core 0.16.1:
    the TP layout only -- the suite's time; the adapter code is the same for every layout. DP=2 in CI: its inf_grad
    is the one a check at megatron DDP's start_grad_sync must name -- issue 52.)"""
    if megatron_core != releases.installed() and layout != "tp":
        pytest.skip(f"{megatron_core} runs the TP layout only (the other layouts run on the installed version)")
    steps = {0: 3, 1: 5}
    faults = [{**CASES[(layout, r)][0], "step": steps[r], "rank": r} for r in (0, 1)]
    block = {"checks": {"enabled": False}, "allow_faults": True, "faults": faults}
    results, lines = run(tmp_path, "run", layout, 7, block)
    ran_on(lines, megatron_core)
    events = [x for x in lines if x.get("event") == "nonfinite"]
    assert [(e["step"], e["ranks"], e["action"]) for e in events] == [(3, [0], "skip_step"), (5, [1], "skip_step")]
    for e, rank in zip(events, (0, 1)):
        fault, coords, layer = CASES[(layout, rank)]
        named = e["detail"]["per_rank"][str(rank)]
        assert {k: named["coords"][k] for k in coords} == coords
        if layer is not None:  # the first non-finite module, with its layer number across pipeline stages
            assert named["localized"]["global_layer"] == layer
            assert fault["module"].split(".", 3)[-1] in named["first_nonfinite_module"]
            assert e["detail"]["affected_ranks"] == [0, 1]
    # every rank skipped steps 3 and 5 together (no hang), and only them; weights stayed finite
    for r in results:
        assert r["applied"] == [True, True, False, True, False, True, True] and r["weights_finite"]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_step_refused_at_its_update_launch_changes_nothing(tmp_path, precision):
    """Issue 52 on megatron-core: DECIDE waits for the update's launch -- megatron's optimizer step, after it read its
    own global norm on the host (trainguard.step.launchgate). A step refused there (a force_action skip: a
    detector's path) leaves the weights, the main weights and the moments bit-identical and is megatron's own "not
    applied"; the steps around it apply."""
    block = {"allow_faults": True, "faults": [{"type": "force_action", "step": 4, "action": "skip"}]}
    results, lines = run(tmp_path, "gate", "tp", 6, block, more=["--digest-each"] + (["--bf16"] if precision == "bf16"
                                                                                     else []))
    (start,) = [x for x in lines if x.get("event") == "run_start"]
    assert start["detail"]["decided_at"] == "the update's launch"
    for r in results:
        assert r["applied"] == [True, True, True, False, True, True] and r["weights_finite"], r["applied"]
        # (each decided at the launch, the refused one refused there -- the process's first at its start)
        assert r["at_launch"] == [True] * 5
        d = r["digests"]
        assert d[3] == d[2] and all(d[i] != d[i - 1] for i in (1, 2, 4, 5)), d


# in CI (30 s): the only test of megatron's measured clipped norm -- long, it let megatron-core 0.19's rename of
# get_main_grads_for_grad_norm leave every metric line's grad_norm_clipped empty
def test_guard_changes_nothing_when_no_fault_fires(tmp_path):
    """50 steps of TP=2 with every hook on (localisation flags, grad checks, probes every 10 steps):
    the same losses and parameters as without the guard, to the last bit."""
    block = {"detectors": {"attention_entropy": {"every": 10}, "activation_range": {"every": 10}}}
    guarded, lines = run(tmp_path, "on", "tp", 50, block)
    plain, _ = run(tmp_path, "off", "tp", 50)
    for g, p in zip(guarded, plain):
        assert g["losses"] == p["losses"] and g["param_sha256"] == p["param_sha256"]
    assert len(guarded[0]["losses"]) == 50 and guarded[0]["losses"][-1] < guarded[0]["losses"][0]
    metrics = [x for x in lines if x["type"] == "metric"]
    assert len(metrics) == 50 and "attention_entropy" in metrics[9]  # the probe read scale_mask_softmax
    # the clipped norm is measured where megatron clipped (its deduplicated main gradients, summed over the
    # TP ranks through the next step's table): it equals megatron's own global norm, cut to clip_grad
    for m in metrics[:-1]:
        assert m["grad_norm_clipped"] == pytest.approx(min(m["grad_norm"], m["clip_limit"]), rel=1e-4), m
    # each rank's own step time rides the table (the straggler detector's input, issue 17)
    assert all(len(m["compute_s"]) == 2 and all(t > 0 for t in m["compute_s"]) for m in metrics)


def test_megatron_lm_argument_extension(tmp_path):
    """Megatron-LM calls extra_args_provider(parser) and uses the parser it returns."""
    import megatron_hooks

    good = tmp_path / "tg.json"
    good.write_text(json.dumps({"trainguard": {"detectors": {"loss_spike": {"z": 8}}}}))
    parser = megatron_hooks.extra_args_provider(argparse.ArgumentParser(prog="pretrain_gpt.py"))
    assert parser.parse_args(["--trainguard-config", str(good)]).trainguard_config == str(good)
    assert parser.parse_args([]).trainguard_config is None
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"detectors": {"loss_spik": {}}}))
    with pytest.raises(SystemExit):
        parser.parse_args(["--trainguard-config", str(bad)])
    with pytest.raises(SystemExit):
        parser.parse_args(["--trainguard-config", str(tmp_path / "missing.json")])


def test_snapshots_resume_exactly_and_reshard_tp2_to_tp1(tmp_path):
    """dist_checkpointing snapshots under trainguard's commit protocol: a TP=2 run saved at
    iterations 4 and 6 resumes at TP=2 to the same parameters and losses as if never stopped, and
    at TP=1 with the same weights (the same loss on a fixed batch); a corrupted newest snapshot is
    passed over for the one before. Dropout 0.1 draws from megatron's tensor-parallel RNG tracker, so
    the exact resume depends on the tracker's states and every RNG being restored (seen failing with
    the sidecar's RNG restore made a no-op)."""
    from trainguard.checkpoint.manifest import verify

    ck = tmp_path / "ck"
    block = {"checks": {"enabled": False}, "checkpoint": {"stable_after": 2, "verify_steps": 2}}
    extra = ["--ckpt", str(ck), "--dropout", "0.1"]

    def go(name, layout, more):
        return run(tmp_path, name, layout, 12, block, extra + more)

    full, _ = go("full", "tp", ["--save-at", "4", "--save-at", "6"])
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("step")) == ["step00000004", "step00000006"]
    assert all(verify(ck / t).ok for t in ("step00000004", "step00000006"))
    assert all((ck / t / "stable.json").exists() and (ck / t / "trajectory.json").exists()
               for t in ("step00000004", "step00000006"))

    resumed, lines = go("resumed", "tp", ["--resume"])
    (resume,) = [x for x in lines if x.get("event") == "resume"]
    assert resume["detail"]["tag"] == "step00000006" and resume["detail"]["rng_restored"]
    # every file dist_checkpointing opened (its pickled .metadata, the .distcp tensors), the sidecar and the guard
    # state were read once on the loading rank and matched against the manifest rank 0 verified
    assert resume["detail"]["verified_on_load"] >= 5, resume["detail"]
    for f, r in zip(full, resumed):
        assert r["first_iteration"] == 6 and r["losses"] == f["losses"][6:]
        assert r["param_sha256"] == f["param_sha256"]
    (check,) = [x for x in lines if x.get("event") == "resume_verified"]  # the resume's own self-test
    assert check["detail"]["ok"] and check["detail"]["max_rel_diff"] == 0.0

    tp1, lines = go("tp1", "dp", ["--resume"])
    (resume,) = [x for x in lines if x.get("event") == "resume"]
    assert resume["detail"]["resharded"]["from"]["tp"] == 2 and resume["detail"]["resharded"]["to"]["tp"] == 1
    assert all(r["probe"]["6"] == full[0]["probe"]["6"] for r in tp1)

    victim = max((p for p in (ck / "step00000006" / "dist").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    fell_back, lines = go("fell_back", "tp", ["--resume"])
    (bad,) = [x for x in lines if x.get("event") == "checkpoint_invalid"]
    assert bad["detail"]["tag"] == "step00000006" and "sha256" in bad["detail"]["reason"]
    assert all(r["first_iteration"] == 4 for r in fell_back)
    assert fell_back[0]["param_sha256"] == full[0]["param_sha256"]  # 4 -> 12 replays the same steps


def test_fp16_grad_scaler_clamp_is_detected_and_the_scale_reset(tmp_path):
    """megatron's DynamicGradScaler clamps silently at its minimum: under 16 overflowing steps plain
    megatron ends at scale 1.0 for good; the guard sees the overflow at the floor, says so, and resets
    the scale (the loss_scale ladder's remedy, applied in place on megatron)."""
    block = {"checks": {"enabled": False}, "allow_faults": True, "recovery": {"ladders": {"loss_scale": ["rollback"]}},
             "faults": [{"type": "fp16_overflow", "step": 5, "rank": 1, "steps": 16}]}
    runs, logs = {}, {}
    for name, more in (("guarded", []), ("plain", ["--no-guard"])):  # (plain: the same faults injected)
        runs[name], logs[name] = run(tmp_path, name, "dp", 30, block, ["--fp16", *more])
    lines = logs["guarded"]
    plain, guarded = runs["plain"][0], runs["guarded"][0]
    # both skipped the 16 overflowing steps (megatron's own found_inf path) and nothing else
    assert plain["applied"] == guarded["applied"] == [True] * 4 + [False] * 16 + [True] * 10
    assert plain["loss_scale"][-1] == 1.0 and min(plain["loss_scale"]) == 1.0  # clamped, silently, for good
    (collapse,) = [x for x in lines if x.get("event") == "loss_scale"]
    assert collapse["detail"]["at_floor"] and collapse["detail"]["onset_step"] == 5
    (reset,) = [x for x in lines if x.get("event") == "loss_scale_reset"]
    assert reset["action"] == "reset_scale" and reset["detail"]["scale_after"] == 1024.0
    overflows = [x for x in lines if x.get("event") == "overflow"]
    assert len(overflows) == 16 and all(x["ranks"] == [1] for x in overflows)
    assert guarded["loss_scale"][-1] > 1.0 and all(r["weights_finite"] for r in runs["guarded"])


def test_your_loop_with_a_replayer_names_the_bad_sample_and_rolls_back_damaged_weights_at_once(tmp_path):
    """Data or weights in a megatron-core loop of your own (issue 23 item 2): install(replayer=Replayer(...)) over
    the loop's forward step, guard.record(...) per micro-batch. TP=2: one NaN sample (row 1 of the first
    micro-batch of step 4, on rank 1) is named alone by both tensor-parallel ranks, which replay in lockstep,
    and skipped without a rollback; NaN in rank 0's weights at step 9 rolls back at once (to 6)."""
    block = {"checks": {"enabled": False}, "allow_faults": True, "recovery": {"ladder_window": 3},
             "faults": [{"type": "nan_batch", "step": 4, "rank": 1, "sample": 1},
                        {"type": "nan_weights", "step": 9, "rank": 0, "param": "decoder.layers.1.mlp.linear_fc1.weight"}],
             "checkpoint": {"dir": str(tmp_path / "ck"), "every_steps": 3, "stable_after": 1, "verify_steps": 2}}
    results, lines = run(tmp_path, "run", "tp", 11, block, ["--replay"])
    nf = {e["step"]: e for e in lines if e.get("event") == "nonfinite"}
    bad = nf[4]
    assert bad["action"] == "skip_step" and bad["detail"]["weights"]["verdict"] == "healthy", bad
    # step 4's first micro-batch (of 2) holds samples 24-27 of the corpus (4 per micro-batch, 2 per step before)
    named = {r: d["sample_ids"] for r, d in bad["detail"]["per_rank"].items() if d.get("narrowed")}
    assert named and all(ids == [25] for ids in named.values()), bad["detail"]["per_rank"]
    assert nf[9]["detail"]["weights"]["verdict"] == "damaged" and nf[9]["action"] == "rollback"
    (rb,) = [e for e in lines if e.get("event") == "rollback"]
    assert rb["step"] == 9 and rb["detail"]["to_step"] == 6 and rb["detail"]["quarantined"] == {}
    assert all(r["weights_finite"] for r in results)


@pytest.mark.long
def test_nonfinite_ladder_rolls_back_to_a_snapshot(tmp_path, megatron_core):
    """DP=2: rank 1's weights are damaged at iteration 10 (a NaN in one element of a layer's weight: memory
    corruption) -> every forward of rank 1 is NaN from then on: skip, skip, then (3 within the ladder window) an
    in-process rollback to the newest stable snapshot from before the first one. Only the reload can heal the
    weights -- skipping cannot -- so a rollback that reloaded nothing would leave rank 1 NaN and fail this
    test (issue 25 item 13: it used NaN losses, which a rollback that reloads nothing survives). Both replicas
    end identical and finite, and the snapshots of the abandoned trajectory are set aside. (Long, ~18 s a release:
    the contract test runs this ladder on megatron-core, and the replayer and SDC tests roll back damaged weights.)"""
    ck = tmp_path / "ck"
    block = {"checks": {"enabled": False}, "allow_faults": True,
             "checkpoint": {"dir": str(ck), "stable_after": 1, "verify_steps": 1},
             "recovery": {"reset_optimizer_moments": True},
             "faults": [{"type": "nan_weights", "step": 10, "rank": 1,
                         "param": "decoder.layers.0.mlp.linear_fc1.weight"}]}
    res, lines = run(tmp_path, "rb", "dp", 16, block, ["--ckpt", str(ck), "--save-at", "4", "--save-at", "8"])
    ran_on(lines, megatron_core)
    actions = [(x["step"], x["action"]) for x in lines if x.get("event") == "nonfinite"]
    assert actions == [(10, "skip_step"), (11, "skip_step"), (12, "rollback")]
    (rb,) = [x for x in lines if x.get("event") == "rollback"]
    assert rb["detail"]["to_tag"] == "step00000008" and rb["detail"]["to_step"] == 8  # 8 stayed clean for 1 step
    # reset_optimizer_moments: both Adam moments of every parameter megatron's optimizer holds, zeroed
    assert rb["detail"]["optimizer_moments_reset"] is True
    assert rb["detail"]["moments_zeroed"] == 2 * res[0]["param_count"]
    # the loop ran 16 iterations; 12 -> 8 put the guard's count 4 back
    assert all(r["guard_iteration"] == 12 for r in res)
    assert res[0]["param_sha256"] == res[1]["param_sha256"] and all(r["weights_finite"] for r in res)


# (the suite's time: the distributed optimizer only -- the float16 optimizer's fallback runs in the TP/PP test
# below, and this test passed with it here too)
# long (75 s; megatron's bf16 fallback runs in the suite at TP=2 (test_bf16_fallback_under_tensor_and_pipeline_parallelism)): `python -m pytest -m long tests`
@pytest.mark.long
@pytest.mark.parametrize("optimizer", ["distributed"])
def test_fp16_ladder_ends_in_bf16_and_a_restart_stays_bf16(tmp_path, optimizer):
    """Overflow after overflow on rank 1 in fp16 (DP=2, megatron's Float16Module, its fp16 optimizer
    -- or its distributed optimizer -- and DynamicGradScaler): the loss_scale ladder rolls back and
    resets the scale, then also raises the floor, then turns the same DDP/optimizer objects into bf16
    ones with the fp32 main parameters and Adam state carried -- and training goes on to a clean bf16
    run's loss. A restart of the fp16 launch script from a snapshot written after the switch comes
    back in bf16 and continues exactly; an fp16 snapshot loads into a bf16 run."""
    import shutil

    ck = tmp_path / "ck"
    block = {"checks": {"enabled": False}, "allow_faults": True,
             "checkpoint": {"stable_after": 1, "verify_steps": 2}, "recovery": {"ladders": {"loss_scale": THREE_RUNGS}},
             "faults": [{"type": "fp16_overflow", "step": 5, "rank": 1, "steps": 40}]}

    def go(name, steps, more):
        return run(tmp_path, name, "dp", steps, block, ["--ckpt", str(ck), *more, *dist_opt])

    dist_opt = ["--dist-opt"] if optimizer == "distributed" else []
    # 120 loop iterations; saves after loop iterations 4 (fp16) and 100 (bf16, after the switch)
    res, lines = go("fp16", 120, ["--fp16", "--save-at", "4", "--save-at", "100"])
    scale = [x for x in lines if x.get("event") == "loss_scale"]
    assert [e["action"] for e in scale] == ["rollback"] * 3
    assert all(e["detail"]["at_floor"] and e["detail"]["onset_step"] == 5 for e in scale)
    rbs = [x for x in lines if x.get("event") == "rollback"]
    assert [r["detail"]["to_tag"] for r in rbs] == ["step00000004"] * 3
    resets = [x for x in lines if x.get("event") == "loss_scale_reset"]
    assert [e["action"] for e in resets] == ["reset_scale", "raise_floor"]
    assert resets[1]["detail"]["min_scale_after"] == 16.0
    (fb,) = [x for x in lines if x.get("event") == "precision_fallback"]
    assert fb["detail"]["to"] == "bf16" and fb["detail"]["optimizer_state"] == "carried"
    assert fb["detail"]["after_rollback"] and fb["detail"]["softmax_modules"] == 4
    assert fb["detail"]["optimizer"] == {"float16": "Float16OptimizerWithFloat16Params",
                                         "distributed": "DistributedOptimizer"}[optimizer]
    # after the switch: no overflow, every step applied (the fault fires while the model is fp16 only)
    after = [m for m in lines[lines.index(fb) + 1:] if m["type"] == "metric"]
    assert not [x for x in lines[lines.index(fb):] if x.get("event") == "overflow"]
    assert [m["step"] for m in after][-1] == 88 and all(m["applied"] and m["loss_scale"] == 1.0 for m in after[1:])
    for r in res:  # 120 iterations, 32 of them undone by the rollbacks or skipped
        assert r["guard_iteration"] == 88 and r["param_dtype"] == "bfloat16" and r["weights_finite"]
    assert res[0]["param_sha256"] == res[1]["param_sha256"]
    clean, _ = go("clean", 88, ["--bf16"])
    got, want = res[0]["eval_loss"], clean[0]["eval_loss"]  # held-out sequences of the training chain
    assert abs(got - want) / want < 0.05, (got, want)

    # a restart of the same fp16 launch: the newest snapshot (iteration 68 = loop 100) is bf16
    resumed, lines = go("restart", 88, ["--fp16", "--resume"])
    (fb,) = [x for x in lines if x.get("event") == "precision_fallback"]
    assert "bf16" in fb["detail"]["reason"] and fb["step"] == 0
    (resume,) = [x for x in lines if x.get("event") == "resume"]
    assert resume["detail"]["tag"] == "step00000068"
    (check,) = [x for x in lines if x.get("event") == "resume_verified"]
    assert check["detail"]["ok"]
    for r, f in zip(resumed, res):  # iterations 68 -> 88 again, on the same batches: the same weights
        assert r["first_iteration"] == 68 and r["param_dtype"] == "bfloat16"
        assert r["param_sha256"] == f["param_sha256"]

    def refused(name, more):
        rc, _ = run_worker(tmp_path / "fp16.json", tmp_path / name, 6, module="tests.support.megatron_worker",
                           extra=["--ckpt", str(ck), "--resume", *more, *dist_opt], timeout=300)
        return rc != 0 and (tmp_path / name / "torchrun.log").read_text()

    if optimizer == "distributed":  # its state on disk follows the DP layout: a TP change is refused, clearly
        assert "was written at TP=1, PP=1 and this run is TP=2, PP=1" in refused("tp2", ["--bf16", "--tp", "2"])
    # the fp16 snapshot of iteration 4 loads into a bf16 run: its weights, from the fp32 masters --
    # except with the distributed optimizer, whose on-disk layout names its buffers by dtype
    shutil.rmtree(ck / "step00000068")
    (ck / "latest").unlink(missing_ok=True)
    if optimizer == "distributed":
        assert "was written in fp16 with the distributed optimizer" in refused("fp16_into_bf16", ["--bf16"])
        return
    old, _ = go("fp16_into_bf16", 6, ["--bf16", "--resume"])
    assert old[0]["first_iteration"] == 4
    assert abs(old[0]["probe"]["4"] - res[0]["probe"]["4"]) / res[0]["probe"]["4"] < 1e-3  # (not the initial 4.88)


@pytest.mark.parametrize("layout", ["tp", pytest.param("pp", marks=pytest.mark.long)])  # (pp: long, 25 s)
def test_bf16_fallback_under_tensor_and_pipeline_parallelism(tmp_path, layout):
    """The same ladder at TP=2 (each rank's attention softmax and its shard of the main parameters)
    and at PP=2 (the pipeline's p2p buffers follow config.pipeline_dtype from fp16 to bf16)."""
    block = {"checks": {"enabled": False}, "allow_faults": True, "recovery": {"ladders": {"loss_scale": THREE_RUNGS}},
             "faults": [{"type": "fp16_overflow", "step": 5, "rank": 1, "steps": 40}]}
    res, lines = run(tmp_path, "o", layout, 120, block, ["--fp16", "--ckpt", str(tmp_path / "ck"), "--save-at", "4"])
    acts = [(x["event"], x["action"]) for x in lines if x.get("event") in ("loss_scale_reset", "precision_fallback")]
    assert acts == [("loss_scale_reset", "reset_scale"), ("loss_scale_reset", "raise_floor"),
                    ("precision_fallback", "bf16_fallback")]
    fb = next(x for x in lines if x.get("event") == "precision_fallback")
    after = [m for m in lines[lines.index(fb) + 1:] if m["type"] == "metric"][1:]
    assert len(after) == 88 - 4 and all(m["applied"] for m in after)
    for r in res:
        assert r["guard_iteration"] == 88 and r["param_dtype"] == "bfloat16" and r["weights_finite"]
    # it learned in bf16: from ln(128) = 4.85 to near the chain's entropy (a clean bf16 run: 1.15 at DP=2)
    (loss,) = [r["eval_loss"] for r in res if r["eval_loss"] is not None][:1]
    assert loss < 1.35


# long (40 s; megatron's snapshots, resume and retention run in the suite's exact-resume, rollback and hang tests): `python -m pytest -m long tests`
@pytest.mark.long
def test_periodic_snapshots_retention_and_automatic_resume(tmp_path):
    """The checkpoint manager on megatron (issue 12): with checkpoint.every_steps the guard writes
    snapshots by itself, keeps keep_last + the newest keep_stable stable ones, and a job launched
    again resumes from the newest valid one at install -- weights, optimizer, RNG and the data
    position the worker registered -- ending where an uninterrupted run ends."""
    ck = tmp_path / "ck"
    block = {"checks": {"enabled": False},
             "checkpoint": {"dir": str(ck), "every_steps": 3, "keep_last": 1, "keep_stable": 1, "stable_after": 2,
                            "verify_steps": 2}}
    clean_block = {"checks": {"enabled": False}}
    first, lines = run(tmp_path, "first", "dp", 16, block, ["--stop-after", "14"])  # (a job cut short)
    saved = [x["detail"]["tag"] for x in lines if x.get("event") == "checkpoint_saved"]
    assert saved == ["step00000001", "step00000003", "step00000006", "step00000009", "step00000012"]  # (1: dir/.first)
    # keep_last 1 + keep_stable 1: when 12 was committed, 9 was the newest stable one (stable at 11)
    kept = sorted(p.name for p in ck.iterdir() if p.name.startswith("step"))
    assert kept == ["step00000009", "step00000012"]
    assert (ck / "step00000009" / "stable.json").exists() and (ck / "step00000012" / "trajectory.json").exists()
    assert all(len(r["applied"]) == 14 for r in first)

    again, lines = run(tmp_path, "again", "dp", 16, block)
    (resume,) = [x for x in lines if x.get("event") == "resume"]
    assert resume["detail"]["tag"] == "step00000012" and resume["detail"]["rng_restored"]
    clean, _ = run(tmp_path, "clean", "dp", 16, clean_block)
    for a, c in zip(again, clean):
        assert a["first_iteration"] == 12 and a["losses"] == c["losses"][12:]
        assert a["param_sha256"] == c["param_sha256"]
    (check,) = [x for x in lines if x.get("event") == "resume_verified"]
    assert check["detail"]["ok"]


def test_keys_megatron_cannot_honour_are_refused_by_name(tmp_path):
    """A key the user set that megatron_hooks cannot apply stops install() -- and Megatron-LM's
    argument parsing -- with its name and the reason (it used to be silently ignored)."""
    import megatron_hooks
    import torch

    from trainguard.errors import ConfigError

    block = {"sanitize": {"max_seq_len": 512}, "recovery": {"skip_batches": 50}}
    with pytest.raises(ConfigError) as e:
        megatron_hooks.install(torch.nn.Linear(2, 2), None, block)
    assert "trainguard.sanitize.max_seq_len: 512 is not applied by megatron_hooks" in str(e.value)
    assert "trainguard.recovery.skip_batches: 50 is not applied by megatron_hooks" in str(e.value)
    cfg = tmp_path / "tg.json"
    cfg.write_text(json.dumps(block))
    parser = megatron_hooks.extra_args_provider(argparse.ArgumentParser(prog="pretrain_gpt.py"))
    with pytest.raises(SystemExit):
        parser.parse_args(["--trainguard-config", str(cfg)])


@pytest.mark.long  # (~25 s: the watchdog is the core's -- DeepSpeed, HF and Slurm hang tests; megatron restarts: Megatron-LM's)
def test_a_hung_rank_is_named_and_the_restart_resumes(tmp_path):
    """The watchdog on megatron-core (issue 15 item 8): rank 1 SIGSTOPs itself at iteration 8 (a hung node).
    Rank 0 blocks in the next collective; its watchdog names rank 1 with its coordinates from the
    heartbeats, and the job exits for torchrun to restart it (--max-restarts=1); the new attempt resumes
    from the newest snapshot by itself and finishes, both replicas identical."""
    ck = tmp_path / "ck"
    block = {"checks": {"enabled": False}, "allow_faults": True,
             "checkpoint": {"dir": str(ck), "every_steps": 3, "stable_after": 1},
             "distributed": {"watchdog": {"interval_s": 0.5, "hang_timeout_s": 5}},
             "faults": [{"type": "hang_rank", "step": 8, "rank": 1}]}
    cfg = tmp_path / "hang.json"
    cfg.write_text(json.dumps(block))
    out = tmp_path / "hang"
    # (under `trainguard run --`: your script's init_process_group of a restarted attempt gets a store
    # prefix of its own, docs/megatron.md)
    rc, res = run_worker(cfg, out, 12, module="tests.support.megatron_worker", timeout=300,
                         launcher=["--max-restarts=1", "--monitor-interval=0.5"],
                         prefix=[sys.executable, "-m", "trainguard.cli", "run", "--"])
    assert rc == 0 and all(res), (out / "torchrun.log").read_text()[-3000:]
    lines = read(out / "trainguard.jsonl")
    (hang,) = [x for x in lines if x.get("event") == "hang_detected"]
    assert hang["ranks"] == [1] and hang["action"] == "restart"
    (culprit,) = hang["detail"]["culprits"]
    # (a stopped process's last published heartbeat is at most interval_s old: with iterations of tens of
    # milliseconds, and the publisher starved on a busy machine, that can be several iterations before 8)
    assert culprit["rank"] == 1 and culprit["coords"]["dp"] == 1 and 1 <= culprit["step"] <= 8
    (restart,) = [x for x in lines if x.get("event") == "restart"]
    (resume,) = [x for x in lines if x.get("event") == "resume"]
    assert restart["time"] > hang["time"] and resume["detail"]["tag"] == "step00000006"
    assert all(r["guard_iteration"] == 12 and r["first_iteration"] == 6 and r["weights_finite"] for r in res)
    assert res[0]["param_sha256"] == res[1]["param_sha256"]


@pytest.mark.long  # (CI's time: the in-memory tier on megatron runs in test_snapshots_resume_exactly_and_reshard_tp2_to_tp1
# and Megatron-LM's test_a_killed_rank_comes_back_from_node_memory_losing_at_most_one_iteration)
def test_the_distributed_optimizer_comes_back_from_node_memory_exactly(tmp_path):
    """The in-memory tier with megatron's distributed optimizer (issue 23 item 3), DP=2: each rank's snapshot
    holds its own shard of the fp32 main parameters and Adam's state (no gather). Rank 1 SIGKILLed at 9,
    torchrun restarts the job, it resumes from node memory (7 or 8; the disk has 6) and ends with the
    parameters of the run that was never interrupted, on both replicas."""
    def block(name, faults):
        return {"checks": {"enabled": False}, "allow_faults": bool(faults), "faults": faults,
                "checkpoint": {"dir": str(tmp_path / name / "ck"), "every_steps": 3,
                               "snapshot": {"every_steps": 1, "dir": str(tmp_path / name / "shm")}}}

    clean, _ = run(tmp_path, "clean", "dp", 12, block("clean", []), ["--dist-opt"])
    cfg = tmp_path / "killed.json"
    cfg.write_text(json.dumps(block("killed", [{"type": "kill_rank", "step": 9, "rank": 1}])))
    out = tmp_path / "killed"
    rc, res = run_worker(cfg, out, 12, extra=["--dist-opt"], module="tests.support.megatron_worker", timeout=300,
                         launcher=["--max-restarts=1", "--monitor-interval=0.5"],
                         prefix=[sys.executable, "-m", "trainguard.cli", "run", "--"])
    assert rc == 0 and all(res), (out / "torchrun.log").read_text()[-3000:]
    lines = read(out / "trainguard.jsonl")
    (resume,) = [x for x in lines if x.get("event") == "resume"]
    d = resume["detail"]
    assert d["tier"] == "memory" and d["step"] in (7, 8) and d["verified_on_load"] == 3, d
    assert res[0]["param_sha256"] == res[1]["param_sha256"] == clean[0]["param_sha256"]


@pytest.mark.long  # (~31 s: another layout's node memory -- the reshard from disk is CI-tested alone; CI's time)
def test_node_memory_of_another_layout_is_passed_over_for_the_disk_snapshots(tmp_path):
    """A shard in node memory is one rank's slices: the job killed at TP=2 (its node memory surviving) and
    relaunched at DP=2 on the same world size resumes from the disk snapshot, which dist_checkpointing
    reshards -- not from a TP=2 shard that does not fit a DP=2 rank."""
    block = {"checks": {"enabled": False}, "allow_faults": True,
             "faults": [{"type": "kill_rank", "step": 9, "rank": 1}],  # (7 is in memory for sure: 8 waited for it)
             "checkpoint": {"dir": str(tmp_path / "ck"), "every_steps": 3,
                            "snapshot": {"every_steps": 1, "dir": str(tmp_path / "shm")}}}
    cfg = tmp_path / "tp.json"
    cfg.write_text(json.dumps(block))
    rc, _ = run_worker(cfg, tmp_path / "tp", 10, extra=LAYOUTS["tp"], module="tests.support.megatron_worker",
                       timeout=300)
    assert rc != 0 and list((tmp_path / "shm").rglob("manifest.json"))  # killed; its snapshots stayed in memory
    results, lines = run(tmp_path, "dp", "dp", 10, {**block, "faults": []})
    (resume,) = [x for x in lines if x.get("event") == "resume"]
    assert resume["detail"]["tag"] == "step00000006" and resume["detail"]["resharded"] is not None, resume
    assert all(r["guard_iteration"] == 10 and r["weights_finite"] for r in results)


@pytest.mark.long  # (CI's time: a spare in megatron's process runs in Megatron-LM's own loop, test_megatron_lm_dist.py)
def test_your_own_loop_survives_a_killed_rank_in_process_with_a_spare(tmp_path):
    """megatron_hooks.supervised (issue 38, your own megatron-core loop): DP=2 and a spare under
    ``torchrun ... -m trainguard.supervise --spares 1 -- -m tests.support.megatron_worker ...``; rank 1 SIGKILLed at
    step 9. The survivor's training function is entered again in its own process on the world formed again with the
    spare, both resume from node memory, nobody restarts, and both replicas end with the parameters of the run that
    was never interrupted."""
    import subprocess

    from trainguard.demo.run import run_bounded, torchrun_env

    def block(name, faults):
        return {"checks": {"enabled": False}, "allow_faults": bool(faults), "faults": faults,
                "checkpoint": {"dir": str(tmp_path / name / "ck"),
                               "snapshot": {"every_steps": 2, "dir": str(tmp_path / name / "shm")}}}

    clean, _ = run(tmp_path, "clean", "dp", 12, block("clean", []))
    cfg = tmp_path / "replaced.json"
    cfg.write_text(json.dumps(block("replaced", [{"type": "kill_rank", "step": 9, "rank": 1}])))
    out = tmp_path / "replaced"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3", "--max-restarts=0",
           "--monitor-interval=0.1", "-m", "trainguard.supervise", "--spares", "1", "--",
           "-m", "tests.support.megatron_worker", "--config", str(cfg), "--steps", "12", "--out", str(out)]
    with open(out / "torchrun.log", "w") as log:
        rc, _, _ = run_bounded(cmd, 300, stdout=log, stderr=subprocess.STDOUT, env=torchrun_env())
    text = (out / "torchrun.log").read_text()
    assert rc == 0 and "spare 0 takes rank 1, generation 1" in text, text[-3000:]
    res = [json.loads((out / f"result.rank{r}.json").read_text()) for r in range(2)]
    lines = read(out / "trainguard.jsonl")
    (rep,) = [x for x in lines if x.get("event") == "rank_replaced"]
    d = rep["detail"]
    assert d["rank"] == 1 and d["resumed_at_step"] in (6, 8) and d["connections_left_open"] == 0, d
    assert not [x for x in lines if x.get("event") == "restart"]
    assert res[0]["param_sha256"] == res[1]["param_sha256"] == clean[0]["param_sha256"]


@pytest.mark.parametrize("layout,more", [("tp", []), pytest.param("pp", [], marks=pytest.mark.long), ("dp", []),
                                         pytest.param("dp", ["--dist-opt"], marks=pytest.mark.long)],
                         ids=["tp", "pp", "dp", "dp-distopt"])  # (pp, dp-distopt: -m long -- CI's time; the fuzz's long half)
def test_fp16_whose_first_steps_were_skipped_restarts_from_its_first_step_and_lives(tmp_path, layout, more):
    """Issue 50's shape on a megatron-core loop: fp16 whose first steps overflow (the first step's snapshot holds no
    optimizer moments), then updates, then a restart to that snapshot (forced at 10) -- at TP=2, at PP=2 (pipeline
    stages whose first steps were skipped), at DP=2, and with the distributed optimizer at DP=2: the loop reaches its
    end with finite weights and nothing failed to load. The first step's checkpoint is each rank's own state, written
    in the background (issue 52: dist_checkpointing's save blocked the first step for seconds) -- what data-parallel
    replicas share written once, by the first replica (at DP=2 without the distributed optimizer the second writes
    nothing; with it, its optimizer shard alone), every replica restarting from the same weights."""
    block = {"checks": {"enabled": False}, "allow_faults": True,
             "checkpoint": {"dir": str(tmp_path / "ck"), "every_steps": 4},
             "faults": [{"type": "fp16_overflow", "step": 1, "rank": 1, "steps": 3},
                        {"type": "force_action", "step": 10, "action": "restart"}]}
    results, lines = run(tmp_path, "o", layout, 16, block, ["--fp16", *more])
    assert results[0]["applied"][:3] == [False] * 3 and all(results[0]["applied"][3:9])
    (rb,) = [x for x in lines if x.get("event") == "rollback"]
    (first,) = [x for x in lines if x.get("event") == "checkpoint_saved" and x["detail"]["dir"].endswith(".first")]
    assert first["step"] == 1 and first["detail"]["async"] is True
    assert rb["step"] == 10 and rb["detail"]["to_step"] == 1 and "from_first_step" in rb["detail"]
    failed = [x for x in lines if x.get("event") == "checkpoint_failed"]
    shards = tmp_path / "ck" / ".first" / "step00000001" / "shard"
    if more:  # the distributed optimizer cannot write its state before its first update (megatron asserts one step):
        # the checkpoint of the restarted run's new start, dist_checkpointing's, fails -- said, never the run's death
        assert [(x["step"], x["detail"]["sync"], [(g["ranks"], g["error"].split(":")[0]) for g in x["detail"]["errors"]])
                for x in failed] == [(1, True, [([0, 1], "AssertionError")])]
        assert (shards / "rank1.pt").stat().st_size < (shards / "rank0.pt").stat().st_size / 2  # (its shard, no weights)
    else:
        assert not failed
    if layout == "dp":
        assert sorted(p.name for p in shards.iterdir()) == (["rank0.pt", "rank1.pt"] if more else ["rank0.pt"])
        assert results[0]["param_sha256"] == results[1]["param_sha256"]  # (the replicas restarted from one state)
    assert all(r["run_length"] == 16 for r in results)  # (install's train_iters: what bounds a restart)
