import json
import subprocess
import sys

import pytest

from trainguard import config as tg
from trainguard.support import reference
from trainguard.errors import ConfigError


def problems(block):
    with pytest.raises(ConfigError) as info:
        tg.parse_block(block)
    return dict(info.value.problems)


def test_defaults_are_valid_and_safe():
    cfg = tg.parse_block({})
    assert cfg.enabled and cfg.detectors.nonfinite.enabled and cfg.detectors.nonfinite.check_grads
    assert cfg.detectors.nonfinite.action == "skip_step"
    assert cfg.faults == [] and cfg.allow_faults is False


def test_unknown_key_names_full_path_with_did_you_mean():
    p = problems({"detectors": {"nonfinite": {"actoin": "skip_step"}}})
    assert list(p) == ["trainguard.detectors.nonfinite.actoin"]
    assert "did you mean 'action'" in p["trainguard.detectors.nonfinite.actoin"]


def test_every_problem_is_reported_at_once():
    p = problems({"metrcs": {}, "detectors": {"nonfinite": {"max_consecutive": 0, "action": "explode"}},
                  "faults": [{"type": "nan_loss", "step": 0, "rank": -1, "stpe": 3}]})
    assert set(p) == {"trainguard.metrcs", "trainguard.detectors.nonfinite.max_consecutive",
                      "trainguard.detectors.nonfinite.action", "trainguard.faults[0].step",
                      "trainguard.faults[0].rank", "trainguard.faults[0].stpe", "trainguard.faults"}
    assert "did you mean 'metrics'" in p["trainguard.metrcs"]
    assert "did you mean 'step'" in p["trainguard.faults[0].stpe"]
    assert "greater than or equal to 1" in p["trainguard.detectors.nonfinite.max_consecutive"]
    assert "(got 0)" in p["trainguard.faults[0].step"]


def test_wrong_types_are_named():
    p = problems({"enabled": "yes please", "metrics": {"every_steps": "often"}})
    assert set(p) == {"trainguard.enabled", "trainguard.metrics.every_steps"}


def test_faults_refused_without_allow_faults():
    fault = {"type": "nan_loss", "step": 3, "rank": 1}
    p = problems({"faults": [fault]})
    assert "allow_faults" in p["trainguard.faults"]
    cfg = tg.parse_block({"faults": [fault], "allow_faults": True})
    assert cfg.faults[0].step == 3 and cfg.faults[0].rank == 1


def test_param_only_for_inf_grad():
    p = problems({"allow_faults": True, "faults": [{"type": "nan_loss", "step": 1, "param": "w"}]})
    assert "inf_grad" in p["trainguard.faults[0]"]


def test_block_must_be_an_object():
    assert problems(["not", "a", "dict"]) == {"trainguard": "must be a JSON object (got list)"}


def test_load_without_block_means_plain_deepspeed(tmp_path):
    f = tmp_path / "ds.json"
    f.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1}))
    ds, block = tg.load(f)
    assert block is None and ds == {"train_micro_batch_size_per_gpu": 1}
    assert tg.load({"trainguard": {"enabled": False}})[1].enabled is False


@pytest.mark.parametrize("text, fragment", [
    ('{"trainguard": {', "not valid JSON at line 1"),
    ('{"trainguard": {}, "trainguard": {}}', "duplicate key 'trainguard'"),
    ('[1, 2]', "top level must be a JSON object"),
])
def test_bad_files_name_the_file(tmp_path, text, fragment):
    f = tmp_path / "broken.json"
    f.write_text(text)
    with pytest.raises(ConfigError) as info:
        tg.load(f)
    assert fragment in str(info.value) and str(f) in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        tg.load(tmp_path / "nope.json")


def test_schema_and_reference_are_in_sync(root):
    schema = json.loads((root / "configs" / "trainguard.schema.json").read_text())
    assert schema == json.loads(json.dumps(reference.json_schema(), sort_keys=True)), \
        "configs/trainguard.schema.json is stale: run python -m trainguard.support.reference"
    assert (root / "docs" / "config-reference.md").read_text() == reference.reference_markdown(), \
        "docs/config-reference.md is stale: run python -m trainguard.support.reference"


def test_the_reference_command_writes_into_this_checkout_by_default(root):
    """``python -m trainguard.support.reference`` without an argument writes the files the test above reads."""
    import inspect

    assert reference.REPO == root and inspect.signature(reference.write_generated).parameters["root"].default == root
    assert (reference.REPO / "configs" / "trainguard.schema.json").is_file()


def test_reference_lists_every_leaf_key(root):
    text = reference.reference_markdown()
    for key in ("trainguard.detectors.nonfinite.action", "trainguard.metrics.per_rank",
                "trainguard.data.seed", "trainguard.faults[].type", "trainguard.allow_faults"):
        assert f"`{key}`" in text


def example_configs(root):
    return sorted(p for p in (root / "configs").glob("*.json") if p.name != "trainguard.schema.json")


def test_every_example_config_validates(root):
    files = example_configs(root) + [root / "trainguard" / "demo" / "demo.json"]
    assert len(files) >= 3
    from trainguard.support.support import check_supported

    for f in files:
        ds, block = tg.load(f)
        assert block is not None, f
        # and the adapter it is an example for honours every key it sets
        adapter = "megatron_hooks" if "megatron" in f.name else "ds_plugins/framework" if "hf" in f.name else "ds_plugins"
        check_supported(block, adapter)


def test_cli_validate_ok_and_error(root, tmp_path):
    ok = subprocess.run([sys.executable, "-m", "trainguard.cli", "validate",
                         str(root / "configs" / "ds_config_zero2_bf16.json")], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines()[0].endswith("DeepSpeed ZeRO-2 bf16") and ": OK:" in ok.stdout.splitlines()[0]
    # what another stack would refuse is said before a launch: its skip_batches and snapshots under HF's Trainer
    hf = [line for line in ok.stdout.splitlines() if line.startswith("  refused under ds_plugins/framework: ")]
    assert len(hf) == 1 and "recovery.skip_batches: 200" in hf[0] and "checkpoint.snapshot.every_steps" in hf[0]
    under = subprocess.run([sys.executable, "-m", "trainguard.cli", "validate", "--under", "ds_plugins/framework",
                            str(root / "configs" / "ds_config_zero2_bf16.json")], capture_output=True, text=True)
    assert under.returncode == 2 and ": REFUSED:" in under.stdout and "megatron_hooks" not in under.stdout
    fits = subprocess.run([sys.executable, "-m", "trainguard.cli", "validate", "--under", "ds_plugins/framework",
                           str(root / "configs" / "ds_config_hf_trainer.json")], capture_output=True, text=True)
    assert fits.returncode == 0 and fits.stdout.count("\n") == 1, fits.stdout
    bad = tmp_path / "bad.json"
    cfg = json.loads((root / "configs" / "ds_config_zero2_bf16.json").read_text())
    cfg["trainguard"]["detectors"]["nonfinite"]["actoin"] = "skip_step"
    cfg["trainguard"]["metrics"]["every_steps"] = -1
    bad.write_text(json.dumps(cfg))
    res = subprocess.run([sys.executable, "-m", "trainguard.cli", "validate", str(bad)],
                         capture_output=True, text=True)
    assert res.returncode == 2
    assert "trainguard.detectors.nonfinite.actoin" in res.stderr and "did you mean 'action'" in res.stderr
    assert "trainguard.metrics.every_steps" in res.stderr
    assert "Traceback" not in res.stderr


def test_megatron_lms_checkpoint_directory_is_refused_for_trainguards_snapshots(tmp_path):
    from types import SimpleNamespace

    from megatron_hooks.lm import _check_dirs
    from trainguard.config import parse_block
    from trainguard.errors import ConfigError

    cfg = parse_block({"checkpoint": {"dir": str(tmp_path / "ckpt")}})
    _check_dirs(cfg, SimpleNamespace(save=str(tmp_path / "megatron"), load=None))  # apart: fine
    with pytest.raises(ConfigError) as e:
        _check_dirs(cfg, SimpleNamespace(save=None, load=str(tmp_path / "ckpt")))
    assert e.value.problems[0][0] == "trainguard.checkpoint.dir" and "--load" in str(e.value)


def test_a_misspelt_top_level_block_is_an_error_not_an_unguarded_run(tmp_path):
    """'trainguad' passed validate ("no trainguard block", exit 0) and the run trained unguarded without a word."""
    import json
    import subprocess
    import sys

    from trainguard.config import load
    from trainguard.errors import ConfigError

    for key in ("trainguad", "Trainguard", "train_guard"):
        with pytest.raises(ConfigError, match=f"{key}: a typo of \"trainguard\"\\? did you mean \"trainguard\""):
            load({"zero_optimization": {"stage": 2}, key: {}})
    assert load({"zero_optimization": {"stage": 2}, "train_batch_size": 8}) [1] is None  # (no block: plain)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "trainguad": {"enabled": True}}))
    res = subprocess.run([sys.executable, "-m", "trainguard.cli", "validate", str(path)], capture_output=True, text=True)
    assert res.returncode == 2 and "trainguad" in res.stderr, (res.stdout, res.stderr)
