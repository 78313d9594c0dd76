"""The support matrix (trainguard/support/releases.json, issue 32): written once, read by the check at start, setup.py's
extras and the README's table; a release outside it refused by name with the range and the override."""
import re
from pathlib import Path

import pytest

from trainguard.support import releases
from trainguard.errors import ConfigError, UnsupportedSetup
from tests.support.require import imported

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def no_override(monkeypatch):
    monkeypatch.delenv(releases.OVERRIDE, raising=False)
    monkeypatch.delenv("TRAINGUARD_ALLOW_UNTESTED_MEGATRON", raising=False)


def test_the_readme_carries_the_matrix_as_the_data_file_says():
    assert releases.table() in (ROOT / "README.md").read_text()


def test_the_extras_floors_are_the_oldest_supported_releases():
    setup = (ROOT / "setup.py").read_text()
    assert 'f"deepspeed>={_floor(\'deepspeed\')}"' in setup and 'f"megatron-core>={_floor(\'megatron-core\')}"' in setup
    assert releases.floor("deepspeed") == "0.16.9" and releases.floor("megatron-core") == "0.16.1"
    assert releases.constraints() == "accelerate<1.17\ndeepspeed<0.20\nmegatron-core<0.20\ntransformers<5.26\n"


@pytest.mark.parametrize("key, inside, outside", [
    ("deepspeed", ["0.16.9", "0.17.6", "0.17.9", "0.19.8", "0.19.10"], ["0.16.8", "0.17.5", "0.18.9", "0.20.0", "0.15.4"]),
    ("transformers", ["4.57.6", "5.24.0", "5.25.0", "5.25.1.dev0"], ["4.56.2", "5.0.0", "5.26.0", "6.0.0"]),
    ("accelerate", ["1.3.0", "1.10.1", "1.16.0"], ["0.34.2", "1.0.0", "1.2.0", "1.17.0", "2.0.0"]),
    ("megatron-core", ["0.16.1", "0.19.2+130ec38"], ["0.16.0", "0.20.0"]),
])
def test_a_release_outside_is_refused_with_the_range_and_the_override(monkeypatch, key, inside, outside):
    for version in inside:
        assert releases.check(key, version) is True, version
    for version in outside:
        with pytest.raises(UnsupportedSetup, match=re.escape(f"{releases.OVERRIDE}={key}")) as e:
            releases.check(key, version)
        assert version in str(e.value) and releases.describe(key) in str(e.value)
    monkeypatch.setenv(releases.OVERRIDE, f"other,{key}")
    assert all(releases.check(key, v) is False for v in outside)  # (let through untested: the caller records it)


def test_a_series_known_not_to_run_says_why():
    with pytest.raises(UnsupportedSetup, match=r"deepspeed 0\.18\.9: does not run on torch 2\.13"):
        releases.check("deepspeed", "0.18.9")
    with pytest.raises(UnsupportedSetup, match=r"accelerate 1\.0\.0: transformers 4\.57's Trainer calls"):
        releases.check("accelerate", "1.0.0")


def test_deepspeed_refuses_at_initialize_before_anything_is_built(monkeypatch):
    """ds_plugins.initialize checks DeepSpeed's release (and, under the zero-code entry, transformers' and
    Accelerate's) before any engine, process group or loader exists."""
    imported("deepspeed")
    import deepspeed

    import ds_plugins

    monkeypatch.setattr(deepspeed, "__version__", "0.18.9")
    monkeypatch.setattr(ds_plugins, "RELEASES", {"checked": {}, "untested": []})  # (module state: not left behind)
    built = []
    monkeypatch.setattr(deepspeed, "initialize", lambda **kw: built.append(kw))
    with pytest.raises(UnsupportedSetup, match="this is deepspeed 0.18.9"):
        ds_plugins.initialize(model=None, config={"train_micro_batch_size_per_gpu": 1, "trainguard": {}})
    assert built == []
    monkeypatch.setenv(releases.OVERRIDE, "deepspeed")
    from trainguard import config as tg_config

    assert ds_plugins.check_releases(tg_config.parse_block({}), framework=False) == {"checked": {"deepspeed": "0.18.9"},
                                                                "untested": ["deepspeed"]}


def test_a_key_a_release_cannot_run_is_refused_by_name(monkeypatch):
    from trainguard import config as tg_config
    from trainguard.support.support import check_release

    monkeypatch.setitem(releases.package("deepspeed").refused, "0.16", {"checkpoint.async": "no async writer here"})
    block = tg_config.parse_block({"checkpoint": {"dir": "x", "async": True}})
    with pytest.raises(ConfigError, match=r"trainguard.checkpoint.async.*DeepSpeed 0.16.9 \(no async writer here\)"):
        check_release(block, "deepspeed", "0.16.9")
    check_release(block, "deepspeed", "0.19.8")
    check_release(tg_config.parse_block({}), "deepspeed", "0.16.9")  # (not set: nothing refused)



def test_under_the_zero_code_entry_a_framework_is_checked_only_when_it_builds_the_engine(monkeypatch):
    """transformers imported by your own loop (a model class) is not what builds the engine: not checked; called
    from the Trainer (transformers on the call stack), its release is."""
    import sys
    import types

    imported("deepspeed")
    import ds_plugins
    from trainguard import config as tg_config

    monkeypatch.setattr(ds_plugins, "RELEASES", {"checked": {}, "untested": []})
    monkeypatch.setitem(sys.modules, "transformers", types.SimpleNamespace(__version__="4.30.0"))
    block = tg_config.parse_block({})
    assert "transformers" not in ds_plugins.check_releases(block, framework=True)["checked"]
    as_the_trainer = {"__name__": "transformers.trainer", "check": ds_plugins.check_releases, "block": block}
    with pytest.raises(UnsupportedSetup, match=r"this is transformers 4\.30\.0"):
        exec("check(block, framework=True)", as_the_trainer)
