"""Hugging Face's Trainer over DeepSpeed with zero code changes (issue 13): an unmodified training
script (tests/support/hf_worker.py knows nothing of trainguard), the block in its ds_config, and
``trainguard run --`` in front of the launch. 2 ranks under torchrun, real transformers Trainer,
real Accelerate, real DeepSpeed engines on gloo."""
import json
import sys

import pytest

from trainguard.demo.run import run_worker
from trainguard.metrics.jsonl import read
from tests.support.require import imported

imported("transformers")
imported("accelerate")
pytestmark = pytest.mark.dist

PREFIX = [sys.executable, "-m", "trainguard.cli", "run", "--"]
DS = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
      "gradient_clipping": "auto", "zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"}}


def trainer(tmp_path, name, block, *extra, steps=10, prefix=PREFIX, launcher=(), ok=True,
            module="tests.support.hf_worker", ds=None):
    """One 2-rank Trainer run in tmp_path/name with ``block`` in its ds_config (None: no block); ``ds``: more of the
    ds_config."""
    out = tmp_path / name
    out.mkdir()
    cfg = {**DS, **(ds or {})}
    if block is not None:
        cfg["trainguard"] = {"metrics": {"jsonl": str(out / "trainguard.jsonl"), "per_rank": True}, **block}
    (out / "ds_config.json").write_text(json.dumps(cfg))
    rc, results = run_worker(out / "ds_config.json", out, steps, extra=["--bf16", *extra], prefix=prefix,
                             launcher=launcher, module=module, timeout=300)
    if ok:
        assert rc == 0 and all(results), (out / "torchrun.log").read_text()[-4000:]
    lines = read(out / "trainguard.jsonl") if (out / "trainguard.jsonl").exists() else []
    return rc, results, lines


@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_a_dirty_sample_is_named_with_its_rank_and_the_step_skipped_everywhere(tmp_path, launcher):
    """Sample 13 holds a NaN (in the data: nothing injected); rank 1 reads it at step 3 (HF's
    seeded sampler). The event names rank 1, its coordinates and sample 13 of its batch --
    carried from the Trainer's own DataLoader through Accelerate to the engine -- and the first
    module whose output went non-finite; every rank skipped that step; the weights stay finite.
    Launched by torchrun, and by the deepspeed launcher."""
    if launcher == "torchrun":
        _, results, lines = trainer(tmp_path, "dirty", {}, "--nan-sample", "13")
    else:
        import os
        import socket

        with socket.socket() as sock:  # a free port for the launcher's rendezvous (its default is a fixed 29500)
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        out = tmp_path / "dirty"
        out.mkdir()
        (out / "ds_config.json").write_text(json.dumps({**DS, "trainguard": {"metrics": {
            "jsonl": str(out / "trainguard.jsonl")}}}))
        deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
        results, lines = launch(out, [*PREFIX, deepspeed, "--num_gpus", "2", "--master_port", str(port),
                                      "--module", "tests.support.hf_worker", "--config", str(out / "ds_config.json"),
                                      "--steps", "10", "--out", str(out), "--nan-sample", "13", "--bf16"])
    (e,) = [x for x in lines if x.get("event") == "nonfinite"]
    assert e["step"] == 3 and e["ranks"] == [1] and e["action"] == "skip_step"
    named = e["detail"]["per_rank"]["1"]
    # the per-sample replay (recovery.narrow_samples) names sample 13 alone, through HF's own batches
    assert named["sample_ids"] == [13] and len(named["batch_sample_ids"]) == 4 and 13 in named["batch_sample_ids"]
    assert named["coords"]["dp"] == 1 and e["detail"]["weights"]["verdict"] == "healthy"
    assert named["first_nonfinite_module"] == "transformer.drop"  # where inputs_embeds enter the model
    for r in results:
        assert r["engine_class"].startswith("Trainguard") and r["skipped_steps"] == 1 and r["weights_finite"]
        assert r["global_step"] == 10
        # the run closed when train() returned (its last save committed, run_end written): a user's script never
        # destroys the Trainer's engine (bench/natural's HF runs had no run_end)
        assert r["guard_closed_after_train"] is True
    (end,) = [x for x in lines if x.get("event") == "run_end"]
    assert end["detail"]["global_steps"] == 10


DS_SCHEDULER = {"scheduler": {"type": "WarmupDecayLR", "params": {
    "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto", "total_num_steps": "auto"}}}


@pytest.mark.parametrize("schedule", [pytest.param("trainer", marks=pytest.mark.long), "deepspeed"])  # (-m long: CI's time)
def test_after_a_rollback_with_an_lr_cut_the_trainers_step_log_and_checkpoints_agree_with_the_engine(tmp_path,
                                                                                                    schedule):
    """Issue 51: HF's Trainer cannot rewind its global_step; a rollback moved the engine's global_steps (and a
    DeepSpeed-side LR schedule) back while the Trainer's step, log and checkpoint-N names went on. Now the engine and
    its schedule go on with the Trainer (the weights come back): a rollback with an LR cut forced at step 6 (cooldown
    3) -- the updates of exactly the next 3 steps use half plain's LR, the engine ends at the Trainer's step, every
    checkpoint-N holds DeepSpeed's global_stepN. The Trainer's logged learning_rate: with a DeepSpeed scheduler
    (ds_config "scheduler") it is the LR the updates used, the cut included; with the Trainer's own (Accelerate steps
    it, DeepSpeed never sees it) it stays the schedule's -- not yet the cut (docs/integrations.md). Either way the run's
    length is read off the schedule (what bounds a restart from the first step: trainguard.recovery.lrcut.no_room)."""
    ds = DS_SCHEDULER if schedule == "deepspeed" else None
    _, plain, plain_lines = trainer(tmp_path, "plain", None, "--save-steps", "4", prefix=(), ds=ds)
    block = {"allow_faults": True, "faults": [{"type": "force_action", "step": 6, "action": "lr_cut"}],
             "recovery": {"lr_cooldown_steps": 3},
             "checkpoint": {"dir": str(tmp_path / "cut" / "tgck"), "every_steps": 2}}
    _, results, lines = trainer(tmp_path, "cut", block, "--save-steps", "4", ds=ds)
    (rb,) = [x for x in lines if x.get("event") == "rollback"]
    assert rb["step"] == 6 and rb["detail"]["lr_factor"] == 0.5
    want = dict(plain[0]["lrs"])
    # (the Trainer logs, at step s, its scheduler's get_last_lr(): DeepSpeed's has stepped by then -- the next update's
    # LR --, Accelerate steps the Trainer's own after the log -- this update's)
    lag = 1 if schedule == "deepspeed" else 0
    used = {m["step"]: m["lr"] for m in lines if m.get("type") == "metric" and m.get("applied")}
    for s in (7, 8, 9, 10):  # (the LR each update used: trainguard's metric line)
        assert used[s] == pytest.approx(want[s - lag] * (0.5 if s < 10 else 1.0), rel=1e-6), (s, used, want)
    for r in results:
        assert r["global_step"] == r["engine_steps"] == 10
        assert r["run_length"] == 10  # (the Trainer's max_steps, read off its schedule: a restart's room)
        got = dict(r["lrs"])
        assert sorted(got) == sorted(want) == list(range(1, 11))
        ratio = {s: got[s] / want[s] for s in want if want[s]}
        cut = [6, 7, 8] if schedule == "deepspeed" else []  # (the LRs of updates 7-9, logged a step early)
        assert [s for s, x in ratio.items() if x == pytest.approx(0.5, rel=1e-6)] == cut, ratio
        assert all(x == pytest.approx(1.0, rel=1e-6) for s, x in ratio.items() if s not in cut), ratio
    hf = tmp_path / "cut" / "hf"
    assert sorted(p.name for p in hf.glob("checkpoint-*")) == ["checkpoint-10", "checkpoint-4", "checkpoint-8"]
    for folder in hf.glob("checkpoint-*"):
        n = folder.name.split("-")[1]
        assert (folder / f"global_step{n}").is_dir(), sorted(p.name for p in folder.iterdir())


SHAPES = (pytest.param("trainer_first", marks=pytest.mark.smoke("zero-code HF Trainer")),
          pytest.param("transformers_attribute", marks=pytest.mark.long),
          pytest.param("training_arguments_first", marks=pytest.mark.long),
          "accelerate_first", "deepspeed_first", "trl")  # (tests/support/hf_shapes.py; two shapes -m long: CI's time)


@pytest.mark.parametrize("shape", SHAPES)
def test_the_zero_code_entry_survives_every_import_order(tmp_path, shape):
    """Issue 32: a user's script opens with ``from transformers import Trainer`` (or ``import transformers``
    then ``transformers.Trainer``, ``TrainingArguments`` first, ``import accelerate`` / ``import deepspeed``
    first, TRL's ``SFTTrainer``) -- its first statement, under ``trainguard run -- torchrun``. The zero-code
    entry loads in the middle of that import (Accelerate inside ``transformers.trainer``) and used to patch the
    half-executed module: both ranks stopped with "partially initialized module 'transformers.trainer' has no
    attribute 'Trainer'" (the first two shapes, transformers 5.25 / 4.57 with accelerate 1.16). Each shape now
    trains guarded and names the dirty sample 13 alone, on rank 1, at step 3."""
    if shape == "trl":
        imported("trl")  # (scripts/setup.sh installs it beside transformers: its absence fails CI, never a green skip)
    _, results, lines = trainer(tmp_path, shape, {}, "--shape", shape, "--nan-sample", "13", steps=4,
                                module="tests.support.hf_shapes")
    (e,) = [x for x in lines if x.get("event") == "nonfinite"]
    assert e["step"] == 3 and e["ranks"] == [1] and e["action"] == "skip_step"
    assert e["detail"]["per_rank"]["1"]["sample_ids"] == [13]
    assert all(r["engine_class"] == "TrainguardDeepSpeedEngine" and r["skipped_steps"] == 1 for r in results)


def test_without_the_block_the_prefixed_job_is_bit_identical(tmp_path):
    """No block, or "enabled": false: trainguard run changes nothing (losses and parameters)."""
    _, plain, _ = trainer(tmp_path, "plain", None, prefix=())
    _, prefixed, _ = trainer(tmp_path, "prefixed", None)
    _, disabled, _ = trainer(tmp_path, "disabled", {"enabled": False})
    for a, b, c in zip(plain, prefixed, disabled):
        assert a["losses"] == b["losses"] == c["losses"] and len(a["losses"]) == 10
        assert a["param_sha256"] == b["param_sha256"] == c["param_sha256"]
        assert a["engine_class"] == b["engine_class"] == c["engine_class"] == "DeepSpeedEngine"


@pytest.fixture(scope="module")
def clean_saving_every_4(tmp_path_factory):
    """An uninterrupted 10-step run saving checkpoint-4 and -8: what a killed run must end equal to."""
    _, clean, _ = trainer(tmp_path_factory.mktemp("hf"), "clean", {}, "--save-steps", "4")
    return clean


def test_a_killed_rank_resumes_through_hf_and_through_trainguard(tmp_path, monkeypatch, clean_saving_every_4):
    """Rank 1 is SIGKILLed at step 7; torchrun restarts the job (a store prefix per attempt, or the
    restarted gloo workers would not connect). It resumes from checkpoint-4 -- through HF's own
    resume_from_checkpoint=True, and through trainguard's automatic resume of a script that just
    calls trainer.train() -- and ends with the same parameters as an uninterrupted run. HF's own resume runs
    authenticated (checkpoint.hmac_key_env, issue 25 item 12): the checkpoints HF asked DeepSpeed to save are
    signed, and HF's resume loads one only after its signature and every file's bytes were checked."""
    from pathlib import Path

    monkeypatch.setenv("TG_HF_KEY", "the-run-key-0123456789")
    clean = clean_saving_every_4
    kill = {"allow_faults": True, "faults": [{"type": "kill_rank", "step": 7, "rank": 1}]}
    for name, block, extra in (("hf_resume", {**kill, "checkpoint": {"hmac_key_env": "TG_HF_KEY"}}, ["--resume"]),
                               ("auto_resume", kill, [])):
        _, results, lines = trainer(tmp_path, name, block, "--save-steps", "4", *extra, launcher=["--max-restarts", "1"])
        (resume,) = [x for x in lines if x.get("event") == "resume"]
        assert resume["detail"]["tag"] == "global_step4" and resume["detail"]["dir"].endswith("checkpoint-4")
        signed = (Path(resume["detail"]["dir"]) / "global_step4" / "manifest.hmac").is_file()
        assert signed == (name == "hf_resume") and resume["detail"]["verified_on_load"] >= 3
        assert [x["detail"]["attempt"] for x in lines if x.get("event") == "restart"] == [1]
        for r, c in zip(results, clean):
            assert r["restart"] == "1" and r["global_step"] == 10
            assert r["param_sha256"] == c["param_sha256"], name
            assert r["losses"] == [x for x in c["losses"] if x[0] > 4]


@pytest.mark.parametrize("during,step,interrupted", [("step", 7, 7), ("save", 8, 9)])
def test_a_killed_rank_is_replaced_by_a_spare_and_the_trainer_goes_on_in_the_survivors_process(
        tmp_path, clean_saving_every_4, during, step, interrupted):
    """Issue 38, where most DeepSpeed users are: the same unmodified Trainer script under
    ``trainguard run -- torchrun --nproc_per_node 3 -m trainguard.supervise --spares 1 -- -m tests.support.hf_worker``.
    Rank 1 is SIGKILLed at step 7 -- or inside the Trainer's save of checkpoint-8, its files written, before the
    commit; the spare -- waiting inside Accelerate's init_process_group since the start, its barrier around the
    dataset passed -- takes rank 1, and rank 0's process is not restarted: its ``Trainer.train()`` is entered again
    (the Trainer and Accelerate let go of the old engine) and resumes, as torchrun's restart would, from checkpoint-4,
    the newest that verifies (the half-saved checkpoint-8 is passed over, then saved again). Both ranks end with the
    parameters of the uninterrupted run; the report names the dead rank and what it cost."""
    out = tmp_path / "spare"
    out.mkdir()
    block = {"metrics": {"jsonl": str(out / "trainguard.jsonl"), "per_rank": True}, "allow_faults": True,
             "faults": [{"type": "kill_rank", "step": step, "rank": 1, "during": during}]}
    (out / "ds_config.json").write_text(json.dumps({**DS, "trainguard": block}))
    cmd = [*PREFIX, sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "3", "--monitor-interval", "0.1",
           "-m", "trainguard.supervise", "--spares", "1", "--", "-m", "tests.support.hf_worker", "--config",
           str(out / "ds_config.json"), "--steps", "10", "--out", str(out), "--save-steps", "4", "--bf16"]
    results, lines = launch(out, cmd)
    log = (out / "launch.log").read_text()
    assert "spare 0 takes rank 1, generation 1" in log and "whole job" not in log, log[-3000:]
    clean = clean_saving_every_4
    for r, c in zip(results, clean):
        assert r["restart"] == "0" and r["global_step"] == 10  # (torchrun never restarted the job)
        assert r["param_sha256"] == c["param_sha256"]
    after = [x for x in clean[0]["losses"] if x[0] > 4]
    # rank 0: one process, its first run's steps up to the kill, then the re-entered run's 5..10; rank 1: the spare's
    assert results[0]["losses"][-len(after):] == after and results[0]["losses"][0][0] == 1
    assert results[1]["losses"] == [x for x in clean[1]["losses"] if x[0] > 4]
    (replaced,) = [x for x in lines if x.get("event") == "rank_replaced"]
    d = replaced["detail"]
    assert replaced["ranks"] == [1] and d["rank"] == 1 and d["generation"] == 1 and "signal 9" in d["why"]
    assert d["interrupted_at_step"] == interrupted and d["resumed_at_step"] == 4 and d["connections_left_open"] == 0
    resumes = [x for x in lines if x.get("event") == "resume"]
    assert [x["detail"]["dir"].rsplit("/", 1)[1] for x in resumes] == ["checkpoint-4"]
    assert not [x for x in lines if x.get("event") == "restart"]
    saved = [x["detail"]["tag"] for x in lines if x.get("event") == "checkpoint_saved"]
    assert saved == ["global_step4", "global_step8", "global_step10"], saved  # (checkpoint-8: committed once)


def test_the_watchdog_names_a_hung_rank_in_a_trainer_run(tmp_path):
    block = {"allow_faults": True, "faults": [{"type": "hang_rank", "step": 4, "rank": 1}],
             "distributed": {"watchdog": {"interval_s": 1, "hang_timeout_s": 5}}}
    rc, _, lines = trainer(tmp_path, "hung", block, ok=False)
    assert rc != 0
    (hang,) = [x for x in lines if x.get("event") == "hang_detected"]
    assert hang["ranks"] == [1] and hang["detail"]["culprits"][0]["rank"] == 1
    assert hang["detail"]["exit_code"] == 75


ACCELERATE_YAML = """compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  deepspeed_config_file: {ds}
  zero3_init_flag: false
num_machines: 1
num_processes: 2
machine_rank: 0
use_cpu: false
"""


def accelerate(tmp_path, name, block, *extra, prefix=PREFIX):
    """``[trainguard run --] accelerate launch --config_file acc.yaml -m tests.support.accelerate_worker``."""
    out = tmp_path / name
    out.mkdir()
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": 2}}
    if block is not None:
        cfg["trainguard"] = {"metrics": {"jsonl": str(out / "trainguard.jsonl"), "per_rank": True}, **block}
    (out / "ds.json").write_text(json.dumps(cfg))
    (out / "acc.yaml").write_text(ACCELERATE_YAML.format(ds=out / "ds.json"))
    return launch(out, [*prefix, sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                        str(out / "acc.yaml"), "-m", "tests.support.accelerate_worker", "--steps", "10", "--out",
                        str(out), *extra])


def launch(out, cmd, env=None):
    """Run a launch command (bounded: its process tree is killed after 300 s); must succeed.
    Returns (per-rank results, the run's trainguard.jsonl lines)."""
    import subprocess

    from trainguard.demo.run import kill_tree, torchrun_env

    with open(out / "launch.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**torchrun_env(), **(env or {})},
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            rc = 124
    assert rc == 0, (out / "launch.log").read_text()[-4000:]
    results = [json.loads((out / f"result.rank{r}.json").read_text()) for r in (0, 1)]
    lines = read(out / "trainguard.jsonl") if (out / "trainguard.jsonl").exists() else []
    return results, lines


# long (35 s; accelerate launch with the block runs in the suite (the tuple-batch test's launcher case), a dict batch's ids under the Trainer tests): `python -m pytest -m long tests`
@pytest.mark.long
def test_accelerate_launch_with_the_block_in_its_deepspeed_config(tmp_path):
    """A plain Accelerate loop (accelerator.prepare / backward / optimizer.step) launched by
    ``accelerate launch`` with a DeepSpeed plugin config that holds the block: guarded, the dirty
    sample named with its id (Accelerate on CPU does not shard this loader: both ranks read sample
    126 at step 3, and both are named), the step skipped; without the block, bit-identical."""
    results, lines = accelerate(tmp_path, "dirty", {}, "--nan-sample", "126")
    (e,) = [x for x in lines if x.get("event") == "nonfinite"]
    assert e["step"] == 3 and e["ranks"] == [0, 1] and e["action"] == "skip_step"
    assert all(126 in e["detail"]["per_rank"][str(r)]["sample_ids"] for r in (0, 1))
    assert all(r["engine_class"] == "TrainguardDeepSpeedEngine" and r["skipped_steps"] == 1 and r["weights_finite"]
               for r in results)
    plain, _ = accelerate(tmp_path, "plain", None, prefix=())
    prefixed, _ = accelerate(tmp_path, "prefixed", None)
    for a, b in zip(plain, prefixed):
        assert a["losses"] == b["losses"] and a["param_sha256"] == b["param_sha256"]
        assert a["engine_class"] == b["engine_class"] == "DeepSpeedEngine"


def plain_accelerate(tmp_path, name, how):
    """Issue 27's script (tests/support/accelerate_plain_worker.py): the DeepSpeed config with the block handed
    to Accelerate as a dict (``DeepSpeedPlugin(hf_ds_config=dict)``), as a JSON path, or through ``accelerate
    launch``'s config file; launched under ``trainguard run``. One sample (37) holds +inf."""
    out = tmp_path / name
    out.mkdir()
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": 2}, "bf16": {"enabled": True},
           "trainguard": {"metrics": {"jsonl": str(out / "trainguard.jsonl"), "per_rank": True}}}
    (out / "ds.json").write_text(json.dumps(cfg))
    worker = ["-m", "tests.support.accelerate_plain_worker", "--steps", "10", "--out", str(out), "--nan-sample", "37"]
    if how == "launcher":
        (out / "acc.yaml").write_text(ACCELERATE_YAML.format(ds=out / "ds.json"))
        cmd = [*PREFIX, sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(out / "acc.yaml"),
               *worker]
    else:
        cmd = [*PREFIX, sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               *worker, "--ds-dict" if how == "dict" else "--ds-file", str(out / "ds.json")]
    return launch(out, cmd, env={"ACCELERATE_USE_DEEPSPEED": "true"})  # (PLATFORM.md: a plugin under torchrun on CPU)


# (a file is long: the dict and `accelerate launch` ways are in CI's selection, and a file is read as DeepSpeed reads it)
@pytest.mark.parametrize("how", ["dict", pytest.param("file", marks=pytest.mark.long), "launcher"])
def test_accelerate_names_the_bad_sample_of_a_tuple_batch_however_the_config_is_given(tmp_path, how):
    """Issue 27: a plain Accelerate script whose loader yields (features, labels) tuples, prepared together
    with the model: the nonfinite record's sample_ids were [] on every rank (a tuple has no room for the
    ids). Now the bad sample's index is named, alone (the per-sample replay: its +inf makes the first
    Linear's output infinite and the gradients NaN while tanh keeps the loss finite -- the replay watches
    every module's output), on both ranks (Accelerate on CPU does not shard this loader), the step skipped
    with no rollback, and the batch is named beside it. (On the previous commit: sample_ids [].)"""
    results, lines = plain_accelerate(tmp_path, how, how)
    (start,) = [x for x in lines if x.get("event") == "run_start"]
    assert start["detail"]["untagged_loaders"] == []
    bad = [x for x in lines if x.get("event") == "nonfinite"]
    # (Accelerate 1.16 on CPU does not shard this loader -- both ranks read sample 37 at the same steps; 1.3, the
    # support matrix's oldest, does: each rank names it when its own batch held it. Each rank records where.)
    held = {r["rank"]: r["bad_batch_at"] for r in results}
    assert bad and [x["step"] for x in bad] == sorted(set(held[0]) | set(held[1]))
    for e in bad:
        assert e["action"] == "skip_step" and e["ranks"] == [r for r in (0, 1) if e["step"] in held[r]]
        for r in e["ranks"]:
            mine = e["detail"]["per_rank"][str(r)]
            assert mine["sample_ids"] == [37] and 37 in mine["batch_sample_ids"] and len(mine["batch_sample_ids"]) == 8
    assert not [x for x in lines if x.get("event") == "rollback"]
    assert all(r["engine_class"] == "TrainguardDeepSpeedEngine" and r["weights_finite"] for r in results)
    assert results[0]["skipped_steps"] == len(bad)
