"""Config fuzzing (issue 15, item 14): thousands of mutated blocks -- wrong types, unknown keys, out of
range, deep nesting, huge numbers, bad paths -- and broken files. Each is refused with a ConfigError
that names a key path (or the file), or accepted; what is accepted is usable: it round-trips through
JSON to the same config, and every adapter's support check answers with a ConfigError or nothing."""
import copy
import json
import random
from pathlib import Path

import pytest

from trainguard.config import ConfigError, parse_block, read_json
from trainguard.support.support import adapters, check_supported

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = [p for p in sorted((ROOT / "configs").glob("*.json")) if p.name != "trainguard.schema.json"]
DEEP = {"a": None}
for _ in range(300):
    DEEP = {"a": DEEP}
VALUES = [True, False, -0.0, 0, -1, 1, 0.5, 1e308, -1e308, 10 ** 30, "", "\x00", "x", "../../etc/passwd", [], [1, "x"],
          {}, {"unknown": 1}, None, DEEP, "é" * 5000]


def leaves(block, path=()):
    if isinstance(block, dict):
        yield path, block
        for k, v in block.items():
            yield from leaves(v, path + (k,))
    elif isinstance(block, list):
        for i, v in enumerate(block):
            yield from leaves(v, path + (i,))


def mutate(block, rng):
    block = copy.deepcopy(block)
    spots = [p for p, _ in leaves(block)] + [p for p, v in leaves(block) if isinstance(v, dict) for p in [p]]
    path = rng.choice(spots)
    node = block
    for k in path:
        node = node[k]
    if isinstance(node, dict) and (not node or rng.random() < 0.3):
        node[rng.choice(["unknown", "enabled", "every", "dir", "z", "\x00"])] = rng.choice(VALUES)
    elif isinstance(node, dict):
        node[rng.choice(sorted(node))] = rng.choice(VALUES)
    return block


def blocks():
    out = [json.loads(p.read_text())["trainguard"] for p in SHIPPED if "trainguard" in json.loads(p.read_text())]
    from trainguard.config import TrainguardConfig

    out.append(json.loads(TrainguardConfig().model_dump_json()))  # every key, at its default
    return out


def check(block):
    try:
        cfg = parse_block(block)
    except ConfigError as e:
        assert e.problems and all(path.startswith("trainguard") for path, _ in e.problems), e.problems
        return False
    again = parse_block(json.loads(cfg.model_dump_json(by_alias=True)))
    assert again == cfg
    for adapter in adapters():
        try:
            check_supported(cfg, adapter)
        except ConfigError as e:
            assert all(path.startswith("trainguard") for path, _ in e.problems)
    return True


def test_mutated_blocks_are_refused_by_path_or_usable():
    rng = random.Random(15)
    accepted = refused = 0
    for base in blocks():
        for _ in range(600):
            block = mutate(base, rng)
            if rng.random() < 0.2:
                block = mutate(block, rng)
            if check(block):
                accepted += 1
            else:
                refused += 1
    assert accepted > 100 and refused > 1000, (accepted, refused)


@pytest.mark.parametrize("block, path", [
    ({"detectors": {"attention_entropy": {"every": True}}}, "trainguard.detectors.attention_entropy.every"),
    ({"recovery": {"lr_factor": True}}, "trainguard.recovery.lr_factor"),
    ({"enabled": -0.0}, "trainguard.enabled"),
    ({"metrics": {"jsonl": ""}}, "trainguard.metrics.jsonl"),
    ({"metrics": {"jsonl": "a\x00b"}}, "trainguard.metrics.jsonl"),
    ({"checkpoint": {"dir": "  "}}, "trainguard.checkpoint.dir"),
    ({"deep": DEEP}, "trainguard.deep"),
])
def test_what_used_to_pass_or_crash_is_refused_by_name(block, path):
    with pytest.raises(ConfigError) as e:
        parse_block(block)
    assert [p for p, _ in e.value.problems] == [path], e.value.problems


@pytest.mark.parametrize("content", [b"", b"\xff\xfe{", b'{"trainguard": {', b"\x00", b"[" * 100000, b"null",
                                     b'{"trainguard": {"enabled": true, "enabled": false}}'])
def test_broken_files_give_a_config_error_naming_the_file(tmp_path, content):
    f = tmp_path / "ds_config.json"
    f.write_bytes(content)
    with pytest.raises(ConfigError) as e:
        read_json(f)
    assert str(f) in str(e.value)


def test_validate_cli_on_a_non_utf8_file_exits_1_without_a_traceback(tmp_path, capsys):
    from trainguard.cli import main

    f = tmp_path / "ds_config.json"
    f.write_bytes(b'{"trainguard": {"metrics": "\xff"}}')
    assert main(["validate", str(f)]) != 0
    out = capsys.readouterr()
    assert "UTF-8" in out.out + out.err and "Traceback" not in out.out + out.err
