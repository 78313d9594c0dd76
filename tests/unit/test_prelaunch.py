"""``trainguard run`` checks every block its command names before it launches anything (issue 53): one message,
exit 2, naming the key -- a bad key, a top-level typo of "trainguard", a callback that does not import -- and
nothing launched; a good block and a JSON that is not a ds_config launch as before. Every example block of README
and configs/ passes the same check as written."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trainguard.support.prelaunch import check, named_files

ROOT = Path(__file__).resolve().parents[2]


def trainguard_run(tmp_path, *args):
    """``trainguard run -- python -c <print> ARGS``: what it prints, and whether the command was launched."""
    cmd = [sys.executable, "-m", "trainguard.cli", "run", "--", sys.executable, "-c", "print('launched')", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    return p.returncode, p.stderr, "launched" in p.stdout


def write(tmp_path, name, data) -> str:
    (tmp_path / name).write_text(json.dumps(data))
    return name


@pytest.mark.parametrize("data,key", [
    ({"trainguard": {"detectors": {"nonfinite": {"actoin": "skip"}}}}, "trainguard.detectors.nonfinite.actoin"),
    ({"train_batch_size": 8, "trainguad": {"enabled": True}}, "trainguad"),
    ({"trainguard": {"callbacks": ["mypkg.alerts:page_oncall"]}}, "trainguard.callbacks[0]"),
    ({"trainguard": {"metrics": {"sinks": [{"type": "nopkg.sinks:Statsd"}]}}}, "trainguard.metrics.sinks[0].type"),
])
def test_a_bad_block_stops_the_launch_with_one_message_naming_the_key(tmp_path, data, key):
    for form in (["--deepspeed", "ds.json"], ["--deepspeed_config=ds.json"], ["--trainguard-config", "ds.json"]):
        write(tmp_path, "ds.json", data)
        rc, err, launched = trainguard_run(tmp_path, *form)
        assert rc == 2 and not launched, (form, rc, err)
        assert key in err and "nothing launched" in err and err.count("problem(s)") == 1 and "Traceback" not in err


def test_a_good_block_and_a_json_that_is_no_ds_config_launch(tmp_path):
    write(tmp_path, "ds.json", {"train_batch_size": 8, "trainguard": {"checkpoint": {"every_steps": 50}}})
    write(tmp_path, "vocab.json", {"the": 0, "a": 1})
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "broken.json").write_text("{not json")
    rc, err, launched = trainguard_run(tmp_path, "--deepspeed", "ds.json", "vocab.json", "list.json", "broken.json",
                                       "missing.json")
    assert rc == 0 and launched and "ds.json: the trainguard block is valid" in err, err
    assert named_files(["--deepspeed", str(tmp_path / "ds.json"), f"--x={tmp_path / 'vocab.json'}", "plain"]) == \
        [(tmp_path / "ds.json", False), (tmp_path / "vocab.json", False)]


def test_what_megatron_hooks_refuses_stops_a_megatron_lm_launch_before_it_starts(tmp_path):
    """``--trainguard-config`` is Megatron-LM's argument: a key megatron_hooks refuses (here ``checkpoint.async``) was
    said valid, the job launched and every rank died at argument parsing (a new user's Megatron-LM trial). Now it is
    refused before the launch; the same key under ``--deepspeed`` (ds_plugins applies it) launches."""
    write(tmp_path, "tg.json", {"trainguard": {"checkpoint": {"async": True}}})
    rc, err, launched = trainguard_run(tmp_path, "pretrain_gpt.py", "--trainguard-config", "tg.json")
    assert rc == 2 and not launched and "trainguard.checkpoint.async" in err and "megatron_hooks" in err, err
    assert "tg.json" in err and "nothing launched" in err, err
    rc, err, launched = trainguard_run(tmp_path, "--deepspeed", "tg.json")
    assert rc == 0 and launched, err
    # (the start-of-run warmup check reads Megatron-LM's --lr-warmup-iters: its key is no longer refused there)
    write(tmp_path, "tg.json", {"trainguard": {"checks": {"min_warmup_steps": 5}}})
    rc, err, launched = trainguard_run(tmp_path, "pretrain_gpt.py", "--trainguard-config", "tg.json")
    assert rc == 0 and launched, err


def test_a_launch_line_that_names_no_block_says_nothing_was_checked(tmp_path):
    """HF's TrainingArguments(deepspeed="ds_config.json") names its ds_config inside the script: nothing on the line to
    check -- said, with the command that checks it now (a new user's launch took a bad key to every rank unwarned)."""
    rc, err, launched = trainguard_run(tmp_path)
    assert rc == 0 and launched and "is read when its engine is built" in err and "trainguard validate" in err, err
    write(tmp_path, "ds.json", {"train_batch_size": 8, "trainguard": {}})
    rc, err, launched = trainguard_run(tmp_path, "--deepspeed", "ds.json")
    assert rc == 0 and "no trainguard block" not in err, err


def test_a_block_alone_is_checked_a_module_beside_the_script_is_found_and_big_data_is_not_read(tmp_path):
    # (from a review: --trainguard-config takes the block itself; python train.py imports from its own folder)
    write(tmp_path, "tg.json", {"detectors": {"loss_spike": {"zz": 1}}})
    rc, err, launched = trainguard_run(tmp_path, "--trainguard-config", "tg.json")
    assert rc == 2 and not launched and "zz" in err, err
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "train.py").write_text("")
    (tmp_path / "app" / "myalerts.py").write_text("def page(record): pass\n")
    write(tmp_path, "tg.json", {"callbacks": ["myalerts:page"]})
    rc, err, launched = trainguard_run(tmp_path, "app/train.py", "--trainguard-config", "tg.json")
    assert rc == 0 and launched, err
    big = tmp_path / "data.json"
    big.write_text('{"trainguard": {"detectors": {"nope": 1}}, "pad": "' + "x" * (1 << 20) + '"}')
    rc, err, launched = trainguard_run(tmp_path, "--train_file", "data.json")
    assert rc == 0 and launched, err  # (a dataset argument: not read)


def test_validate_finds_the_modules_the_block_names(tmp_path):
    write(tmp_path, "ds.json", {"trainguard": {"callbacks": ["mypkg.alerts:page_oncall"]}})
    p = subprocess.run([sys.executable, "-m", "trainguard.cli", "validate", "ds.json"], capture_output=True,
                       text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 2 and "trainguard.callbacks[0]: cannot import 'mypkg.alerts': no module 'mypkg'" in \
        p.stderr, p.stderr
    write(tmp_path, "ds.json", {"trainguard": {"callbacks": ["json:dumps"]}})  # (a callable that imports)
    assert subprocess.run([sys.executable, "-m", "trainguard.cli", "validate", "ds.json"], capture_output=True,
                          timeout=120, cwd=tmp_path).returncode == 0


def readme_blocks():
    text = (ROOT / "README.md").read_text()
    for m in re.finditer(r"```json\n(.*?)```", text, re.S):
        body = m.group(1).strip()
        if body.startswith('"trainguard"'):
            yield json.loads("{" + body + "}")
        elif '"trainguard"' in body and body.startswith("{"):
            yield json.loads(body)


def test_every_example_block_passes_as_written(tmp_path):
    examples = list(readme_blocks())
    assert examples, "README's example blocks were not found"
    for i, data in enumerate(examples):
        assert check(tmp_path / write(tmp_path, f"readme{i}.json", data)) is not None
    configs = sorted((ROOT / "configs").glob("*.json"))
    for path in configs:
        if path.name == "trainguard.schema.json":
            continue
        data = json.loads(path.read_text())
        if "trainguard" in data:
            assert check(path) is not None, path


def test_validate_describes_the_block_for_the_framework_it_will_run_under(tmp_path):
    # (issue 53: a Megatron-LM block was described as "clipping=deepspeed ... DeepSpeed ZeRO-0 fp32")
    def said(data):
        write(tmp_path, "x.json", data)
        p = subprocess.run([sys.executable, "-m", "trainguard.cli", "validate", "x.json"], capture_output=True,
                           text=True, timeout=120, cwd=tmp_path)
        assert p.returncode == 0, p.stderr
        return p.stdout
    alone = said({"trainguard": {"checkpoint": {"dir": "ck"}}})
    assert "Megatron-LM's --trainguard-config" in alone and "DeepSpeed" not in alone and "clipping=the framework" in alone
    ds = said({"train_batch_size": 8, "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}, "trainguard": {}})
    assert ds.rstrip().endswith("DeepSpeed ZeRO-2 bf16") and "clipping=deepspeed" in ds
    # a new user's trial: HF's "auto" read as bf16 (the run was fp32), and validate's detectors not the banner's
    hf = said({"bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2}, "trainguard": {}})
    assert "ZeRO-2 with the precision your trainer's arguments give ('auto')" in hf and " bf16" not in hf
    from trainguard.config import parse_block
    from trainguard.metrics.console import ConsoleSink

    banner = ConsoleSink(parse_block({})).banner({})
    listed = hf.split("detectors=")[1].split(",")[0].split("+")
    assert banner.split("detectors: ")[1].split(";")[0].split(", ") == ["nonfinite"] + listed
    assert "checkpoints=your framework's own saves, committed and verified" in hf and \
        "checkpoints: your framework's own saves, committed and verified" in banner  # (one description, both places)


def test_an_accelerate_launch_is_checked_through_the_yaml_it_names(tmp_path, monkeypatch):
    """``accelerate launch --config_file acc.yaml train.py``: the ds_config is named inside Accelerate's YAML
    (deepspeed_config.deepspeed_config_file), not on the line -- a new user's Accelerate job launched unchecked. Now
    it is read through the YAML (or Accelerate's default config file): a bad key stops the launch with one message."""
    from trainguard.support.prelaunch import check_command

    write(tmp_path, "ds.json", {"train_batch_size": 8, "trainguard": {"detectors": {"loss_spik": {}}}})
    (tmp_path / "acc.yaml").write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n"
                                       "  deepspeed_config_file: ds.json\n  zero3_init_flag: false\nnum_processes: 2\n")
    cmd = [sys.executable, "-m", "trainguard.cli", "run", "--", "accelerate", "launch", "--config_file", "acc.yaml",
           "train.py"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 2 and "nothing launched" in p.stderr and "loss_spik" in p.stderr and "ds.json" in p.stderr, \
        p.stderr
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "ds.json", {"train_batch_size": 8, "trainguard": {}})
    assert [str(f) for f, _ in check_command(["accelerate", "launch", "--config-file=acc.yaml", "train.py"])] == \
        ["ds.json"]
    home = tmp_path / "hf"
    (home / "accelerate").mkdir(parents=True)
    (home / "accelerate" / "default_config.yaml").write_text((tmp_path / "acc.yaml").read_text())
    monkeypatch.setenv("HF_HOME", str(home))
    assert [str(f) for f, _ in check_command(["accelerate", "launch", "train.py"])] == ["ds.json"]  # (the default)
    assert check_command(["python", "train.py", "launch"]) == []  # (not Accelerate's launcher: no YAML read)
    (tmp_path / "other.yaml").write_text("deepspeed_config:\n  deepspeed_config_file: none.json\n")
    assert [str(f) for f, _ in check_command(["accelerate", "launch", "train.py", "--config_file", "other.yaml"])] \
        == ["ds.json"]  # (a --config_file after the script is the script's: Accelerate's default config is read)
