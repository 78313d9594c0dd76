"""Hugging Face's Trainer over DeepSpeed with zero code changes (issue 13): an unmodified training
script (tests/support/hf_worker.py knows nothing of trainguard), the block in its ds_config, and
``trainguard run --`` in front of the launch. 2 ranks under torchrun, real transformers Trainer,
real Accelerate, real DeepSpeed engines on gloo."""
import json
import sys

import pytest

from trainguard.demo.run import run_worker
from trainguard.metrics.jsonl import read

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytestmark = pytest.mark.dist

PREFIX = [sys.executable, "-m", "trainguard.cli", "run", "--"]
DS = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
      "gradient_clipping": "auto", "zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"}}


def trainer(tmp_path, name, block, *extra, steps=10, prefix=PREFIX, launcher=(), ok=True):
    """One 2-rank Trainer run in tmp_path/name with ``block`` in its ds_config (None: no block)."""
    out = tmp_path / name
    out.mkdir()
    cfg = dict(DS)
    if block is not None:
        cfg["trainguard"] = {"metrics": {"jsonl": str(out / "trainguard.jsonl"), "per_rank": True}, **block}
    (out / "ds_config.json").write_text(json.dumps(cfg))
    rc, results = run_worker(out / "ds_config.json", out, steps, extra=["--bf16", *extra], prefix=prefix,
                             launcher=launcher, module="tests.support.hf_worker", timeout=300)
    if ok:
        assert rc == 0 and all(results), (out / "torchrun.log").read_text()[-4000:]
    lines = read(out / "trainguard.jsonl") if (out / "trainguard.jsonl").exists() else []
    return rc, results, lines


def test_a_dirty_sample_is_named_with_its_rank_and_the_step_skipped_everywhere(tmp_path):
    """Sample 13 holds a NaN (in the data: nothing injected); rank 1 reads it at step 3 (HF's
    seeded sampler). The event names rank 1, its coordinates and the sample ids of its batch --
    carried from the Trainer's own DataLoader through Accelerate to the engine -- and the first
    module whose output went non-finite; every rank skipped that step; the weights stay finite."""
    _, results, lines = trainer(tmp_path, "dirty", {}, "--nan-sample", "13")
    (e,) = [x for x in lines if x.get("event") == "nonfinite"]
    assert e["step"] == 3 and e["ranks"] == [1] and e["action"] == "skip_step"
    named = e["detail"]["per_rank"]["1"]
    assert 13 in named["sample_ids"] and len(named["sample_ids"]) == 4 and named["coords"]["dp"] == 1
    assert named["first_nonfinite_module"] == "transformer.drop"  # where inputs_embeds enter the model
    for r in results:
        assert r["engine_class"].startswith("Trainguard") and r["skipped_steps"] == 1 and r["weights_finite"]
        assert r["global_step"] == 10


def test_without_the_block_the_prefixed_job_is_bit_identical(tmp_path):
    """No block, or "enabled": false: trainguard run changes nothing (losses and parameters)."""
    _, plain, _ = trainer(tmp_path, "plain", None, prefix=())
    _, prefixed, _ = trainer(tmp_path, "prefixed", None)
    _, disabled, _ = trainer(tmp_path, "disabled", {"enabled": False})
    for a, b, c in zip(plain, prefixed, disabled):
        assert a["losses"] == b["losses"] == c["losses"] and len(a["losses"]) == 10
        assert a["param_sha256"] == b["param_sha256"] == c["param_sha256"]
        assert a["engine_class"] == b["engine_class"] == c["engine_class"] == "DeepSpeedEngine"


def test_a_killed_rank_resumes_through_hf_and_through_trainguard(tmp_path):
    """Rank 1 is SIGKILLed at step 7; torchrun restarts the job (a store prefix per attempt, or the
    restarted gloo workers would not connect). It resumes from checkpoint-4 -- through HF's own
    resume_from_checkpoint=True, and through trainguard's automatic resume of a script that just
    calls trainer.train() -- and ends with the same parameters as an uninterrupted run."""
    _, clean, _ = trainer(tmp_path, "clean", {}, "--save-steps", "4")
    kill = {"allow_faults": True, "faults": [{"type": "kill_rank", "step": 7, "rank": 1}]}
    for name, extra in (("hf_resume", ["--resume"]), ("auto_resume", [])):
        _, results, lines = trainer(tmp_path, name, kill, "--save-steps", "4", *extra, launcher=["--max-restarts", "1"])
        (resume,) = [x for x in lines if x.get("event") == "resume"]
        assert resume["detail"]["tag"] == "global_step4" and resume["detail"]["dir"].endswith("checkpoint-4")
        assert [x["detail"]["attempt"] for x in lines if x.get("event") == "restart"] == [1]
        for r, c in zip(results, clean):
            assert r["restart"] == "1" and r["global_step"] == 10
            assert r["param_sha256"] == c["param_sha256"], name
            assert r["losses"] == [x for x in c["losses"] if x[0] > 4]


def test_the_watchdog_names_a_hung_rank_in_a_trainer_run(tmp_path):
    block = {"allow_faults": True, "faults": [{"type": "hang_rank", "step": 4, "rank": 1}],
             "distributed": {"watchdog": {"interval_s": 1, "hang_timeout_s": 5}}}
    rc, _, lines = trainer(tmp_path, "hung", block, ok=False)
    assert rc != 0
    (hang,) = [x for x in lines if x.get("event") == "hang_detected"]
    assert hang["ranks"] == [1] and hang["detail"]["culprits"][0]["rank"] == 1
    assert hang["detail"]["exit_code"] == 75
