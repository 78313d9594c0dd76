"""The closed record vocabulary (issue 12), the per-adapter key support, and the user's callbacks."""
import json
import re
import time
from pathlib import Path

import pytest

from trainguard.config import parse_block
from trainguard.errors import ConfigError
from trainguard.events import Record
from trainguard.support.support import adapters, check_supported, declared, leaf_keys, refusal

ROOT = Path(__file__).resolve().parents[2]


def _documented_records() -> set[str]:
    text = (ROOT / "docs" / "events.md").read_text()
    table = text.split("| `event` | when |", 1)[1].split("\n\n", 1)[0]
    names = set()
    for row in table.splitlines()[2:]:
        first_cell = row.split("|")[1]
        names |= set(re.findall(r"`([a-z_0-9]+)`", first_cell))
    return names


def test_events_md_lists_exactly_the_record_enum():
    assert _documented_records() == {r.value for r in Record}


def test_emit_refuses_a_record_outside_the_vocabulary(tmp_path):
    from trainguard.observe.eventlog import EventLog

    log = EventLog(rank=0)
    log.open(parse_block({"metrics": {"jsonl": str(tmp_path / "l.jsonl")}}))
    with pytest.raises(TypeError, match="members of trainguard.events.Record"):
        log.emit(1, "rollback")
    log.emit(1, Record.ROLLBACK, [0], "rollback", {"to_step": 0})
    log.close()
    assert '"event":"rollback"' in (tmp_path / "l.jsonl").read_text()


def test_no_raw_record_strings_in_the_code():
    """Every record is written through EventLog.emit with a Record member: no adapter or core module
    writes a raw event name (the old ``guard._emit(step, "rollback", ...)``)."""
    pattern = re.compile(r"\b(_emit|\.event)\(\s*[^,]+,\s*\"")
    offenders = []
    for pkg in ("trainguard", "ds_plugins", "megatron_hooks"):
        for path in (ROOT / pkg).rglob("*.py"):
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not offenders, offenders


def test_every_leaf_key_is_classified_and_every_refusal_names_its_key():
    keys = leaf_keys()
    assert len(keys) > 90 and "recovery.skip_batches" in keys and "faults[].type" in keys
    assert adapters() == ("ds_plugins", "ds_plugins/framework", "ds_plugins/own", "megatron_hooks")  # (installed)
    for path in {p for table in declared().values() for p in table}:  # the declarations name real keys
        assert any(k == path or (path.endswith(".") and k.startswith(path)) for k in keys), path
    for key in keys:
        for adapter in adapters():
            r = refusal(key, adapter)
            if r is None:
                continue
            block = _block_setting(key, r)
            with pytest.raises(ConfigError) as e:
                check_supported(parse_block(block), adapter)
            assert f"trainguard.{key}" in str(e.value) and adapter in str(e.value) and r.reason in str(e.value)
            for inert in r.inert:  # a value that does nothing is accepted (where the key's type allows it)
                try:
                    cfg = parse_block(_block_setting(key, r, inert))
                except ConfigError:
                    continue
                check_supported(cfg, adapter)
    check_supported(parse_block({}), "megatron_hooks")  # defaults are never refused


# a value that does something, per refused key
_ACTIVE = {"sanitize.max_seq_len": 512, "sanitize.vocab_size": 100, "sanitize.pad_id": 0, "sanitize.enabled": True,
           "sanitize.input_key": "ids", "sanitize.label_key": "y", "sanitize.ignore_index": -1,
           "sanitize.reject_all_zero": False, "sanitize.action": "fail", "data.shuffle": False, "data.seed": 3,
           "data.drop_last": False, "distributed.collective_timeout_s": 60.0,
           "distributed.fresh_store_per_attempt": True, "recovery.skip_batches": 10, "checkpoint.async": True,
           "clipping.mode": "value", "clipping.value": 0.5, "faults[].type": "bad_label",
           "checkpoint.snapshot.every_steps": 5}


_UNSET = object()


def _block_setting(key, r, value=_UNSET):
    value = _ACTIVE[key] if value is _UNSET else value
    if key.startswith("faults[]."):
        return {"allow_faults": True, "faults": [{"type": value, "step": 1}]}
    *path, name = key.split(".")
    block = {name: value}
    for part in reversed(path):
        block = {part: block}
    if key.startswith("checkpoint.snapshot."):
        block["checkpoint"]["dir"] = "ckpt"  # (the in-memory tier belongs to a checkpoint directory's run)
    return block


def test_honoured_keys_are_read_by_the_code_of_each_adapter():
    """A key an adapter honours is read somewhere in the core or that adapter (a key nobody reads
    would be set and ignored). Static, but it fails when a key is added and never wired."""
    core = "\n".join(p.read_text() for p in (ROOT / "trainguard").rglob("*.py") if p.name != "support.py")
    for adapter in adapters():
        code = core + "\n".join(p.read_text() for p in (ROOT / adapter.split("/")[0]).rglob("*.py"))
        unread = []
        for key in leaf_keys():
            r = refusal(key, adapter)
            if r is not None:  # (refused where it would do something: nothing to read)
                continue
            name = key.rsplit(".", 1)[-1].replace("[]", "")
            attr = {"async": "async_", "type": "type"}.get(name, name)
            if not re.search(rf"\.{attr}\b|\[\"{name}\"\]|\"{name}\"", code):
                unread.append(key)
        assert not unread, (adapter, unread)


def test_a_callback_named_in_the_block_gets_records_off_the_hot_path(tmp_path):
    from trainguard.observe.eventlog import EventLog

    seen = []
    import tests.unit.test_vocabulary_and_support as me

    me.SEEN = seen
    log = EventLog(rank=0)
    log.open(parse_block({"callbacks": ["tests.unit.test_vocabulary_and_support:_record",
                                        "tests.unit.test_vocabulary_and_support:_broken"]}))
    log.emit(3, Record.NONFINITE, [1], "skip_step", {"x": float("nan")})
    log.close()
    assert seen == [{"type": "event", "step": 3, "event": "nonfinite", "ranks": [1], "action": "skip_step",
                     "detail": {"x": None}}]
    for bad, why in (("tests.unit.nope:f", "cannot import"), ("tests.unit.test_vocabulary_and_support:nope",
                                                                 "has no attribute"), ("no_colon", "of the form")):
        with pytest.raises(ConfigError, match=re.escape("trainguard.callbacks[0]") + ".*" + why):
            EventLog(rank=1).open(parse_block({"callbacks": [bad]}))


SEEN: list = []


def _record(record):
    time.sleep(0.01)
    SEEN.append(record)


def _broken(record):
    raise RuntimeError("a broken user callback")


class LossAbove:
    """A user's detector (trainguard.plugins.Detector): alert when the mean loss is above a limit."""

    def __init__(self, limit):
        self.limit = limit

    def observe(self, step, obs):
        from trainguard.verdicts import Verdict

        losses = [o.loss for o in obs if o.has_loss]
        if losses and sum(losses) / len(losses) > self.limit:
            return [Verdict("loss_above", "loss_too_high", (0,), {"limit": self.limit})]
        return []


class ListSink:
    """A user's sink (trainguard.plugins.Sink)."""

    made: list = []

    def __init__(self, tag):
        self.tag, self.metrics, self.events, self.closed = tag, [], [], False
        ListSink.made.append(self)

    def metric(self, step, values):
        self.metrics.append((step, values["loss"]))

    def event(self, step, event, ranks, action, detail):
        self.events.append((step, event, action))

    def close(self):
        self.closed = True


def test_custom_detectors_and_sinks_by_type(tmp_path):
    import torch

    from trainguard.step.guard import StepGuard
    from trainguard.ranks.isolation import RankCoords
    from trainguard.metrics.jsonl import read

    me = "tests.unit.test_vocabulary_and_support"
    cfg = parse_block({"detectors": {"custom": [{"type": f"{me}:LossAbove", "options": {"limit": 3.0}}]},
                       "metrics": {"jsonl": str(tmp_path / "l.jsonl"),
                                   "sinks": [{"type": f"{me}:ListSink", "options": {"tag": "mine"}}]}})
    g = StepGuard(cfg, rank=0, world=1)
    g.on_begin([RankCoords(0, 0, 0, 0, "h", 0)], {})
    for step, loss in ((1, 2.5), (2, 4.0), (3, 2.0)):
        g.on_loss(step, torch.tensor(loss))
        obs = g.on_agree(step)
        d = g.on_decide(step, obs)
        g.on_step(step, d, applied=True)
        g.on_end(step, obs, {"grad_norm": None, "applied": True})
    g.on_close()
    (alert,) = [x for x in read(tmp_path / "l.jsonl") if x.get("event") == "custom_alert"]
    assert alert["step"] == 2 and alert["action"] == "alert" and alert["detail"]["anomaly"] == "loss_too_high"
    sink = ListSink.made[-1]
    assert sink.tag == "mine" and sink.closed and [s for s, _ in sink.metrics] == [1, 2, 3]
    assert (2, "custom_alert", "alert") in sink.events
    for block, key, why in (
            ({"detectors": {"custom": [{"type": f"{me}:Nope"}]}}, "trainguard.detectors.custom[0].type", "no attribute"),
            ({"detectors": {"custom": [{"type": f"{me}:LossAbove", "options": {"limt": 1}}]}},
             "trainguard.detectors.custom[0].options", "unexpected keyword"),
            ({"detectors": {"custom": [{"type": f"{me}:ListSink", "options": {"tag": 1}}]}},
             "trainguard.detectors.custom[0].type", "does not implement Detector")):
        with pytest.raises(ConfigError) as e:
            StepGuard(parse_block(block), rank=0, world=1)
        assert key in str(e.value) and why in str(e.value), str(e.value)
    with pytest.raises(ConfigError, match=re.escape("trainguard.metrics.sinks[0].type") + ".*registered name"):
        g = StepGuard(parse_block({"metrics": {"sinks": [{"type": "statsd"}]}}), rank=0, world=1)
        g.on_begin([RankCoords(0, 0, 0, 0, "h", 0)], {})


def test_the_zero_code_entry_guards_only_training_engines_with_an_enabled_block():
    """deepspeed.initialize goes through ds_plugins.initialize only with an enabled block and an
    optimizer (given, as parameters, or configured); otherwise it is DeepSpeed's own call."""
    from ds_plugins.auto import _wants_guard

    block = {"trainguard": {}}
    assert not _wants_guard({"config": {"zero_optimization": {"stage": 2}}, "optimizer": object()})  # no block
    assert not _wants_guard({"config": {"trainguard": {"enabled": False}}, "optimizer": object()})
    assert not _wants_guard({"config_params": dict(block)})  # evaluation / inference: no optimizer
    assert _wants_guard({"config_params": dict(block), "optimizer": object()})
    assert _wants_guard({"config": dict(block), "model_parameters": []})
    assert _wants_guard({"config": {**block, "optimizer": {"type": "AdamW"}}})
    with pytest.raises(ConfigError, match="detectors.nonfinite.actoin"):  # a bad block still fails fast
        _wants_guard({"config": {"trainguard": {"detectors": {"nonfinite": {"actoin": 1}}}}, "optimizer": object()})


def test_under_hfs_trainer_a_bad_block_names_the_file_the_user_wrote(tmp_path):
    """HF's Trainer reads the user's ds_config into a dict before trainguard sees it: the error on every rank named
    no file (a new user's trial, issue 53). It names the file TrainingArguments.deepspeed gave."""
    import types

    from ds_plugins.auto import _block_of_args

    path = tmp_path / "ds_config.json"
    raw = {"trainguard": {"detectors": {"nonfinite": {"actoin": 1}}}}
    path.write_text(json.dumps(raw))
    args = types.SimpleNamespace(deepspeed=str(path), hf_deepspeed_config=types.SimpleNamespace(config=raw))
    with pytest.raises(ConfigError, match=re.escape(f"in {path}:")) as err:
        _block_of_args(args)
    assert "detectors.nonfinite.actoin" in str(err.value)
    args = types.SimpleNamespace(deepspeed=dict(raw), hf_deepspeed_config=None)  # (a dict given: none to name)
    with pytest.raises(ConfigError, match="problem.s. in the trainguard config:"):
        _block_of_args(args)
    # (the APIs that take the block alone take a dict too: megatron_hooks.install(config={...}))
    from trainguard.config.parsing import block_of

    assert block_of({"checkpoint": {"every_steps": 5}}).checkpoint.every_steps == 5
    assert block_of({"trainguard": {"enabled": False}}).enabled is False
    with pytest.raises(ConfigError, match="detectors.nonfinite.actoin"):
        block_of(raw)


def test_every_capability_row_names_the_tests_that_prove_it():
    """Issue 15: every ✅ row of docs/capabilities.md names the test file(s) that prove it, and they exist."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    rows = [line for line in (root / "docs" / "capabilities.md").read_text().splitlines()
            if line.startswith("| ") and "✅" in line]
    assert len(rows) > 20
    for row in rows:
        proof = row.rstrip(" |").rsplit(" | ", 1)[-1]
        files = re.findall(r"tests/(?:unit|dist)/[a-z_]+\.py", proof)
        assert files, f"no test named for: {row[:100]}"
        for f in files:
            assert (root / f).is_file(), f


def test_an_optimizer_without_a_skip_path_is_refused_by_name():
    """Issue 15 item 10: an optimizer the guard cannot skip is refused when the engine is guarded (the
    engine calls find_strategy at construction), with what is supported -- not at the first bad step."""
    import pytest
    import torch

    from ds_plugins.skip import find_strategy
    from trainguard.errors import UnsupportedSetup

    class OneBitThing:  # e.g. an optimizer that is no torch.optim.Optimizer
        pass

    with pytest.raises(UnsupportedSetup, match="OneBitThing.*supported: .*DeepSpeedZeroOptimizer"):
        find_strategy(OneBitThing())
    assert find_strategy(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)) is not None


def test_megatron_releases_outside_the_tested_range_are_refused_by_version(monkeypatch):
    """The adapter and Megatron-LM's loop run only on the megatron-core releases of the support matrix
    (0.16.1-0.19.x; Megatron-LM's loop from 0.17.1); outside, the error names the version, the range
    and the way out (the older switch still works)."""
    from trainguard.errors import UnsupportedSetup
    from trainguard.support.releases import check

    monkeypatch.delenv("TRAINGUARD_ALLOW_UNTESTED", raising=False)
    monkeypatch.delenv("TRAINGUARD_ALLOW_UNTESTED_MEGATRON", raising=False)
    for ok in ("0.16.1", "0.17.1", "0.19.2", "0.19.2+130ec38", "0.19.5"):
        assert check("megatron-core", ok)  # (megatron_hooks.install's check)
    check("megatron-lm", "0.19.0rc1")      # (--trainguard-config's: megatron_hooks.args)
    for old, key in (("0.16.0", "megatron-core"), ("0.16.1", "megatron-lm"), ("0.20.0", "megatron-core"),
                     ("1.0.0", "megatron-lm")):
        with pytest.raises(UnsupportedSetup, match=rf"this is megatron-core {old}.*TRAINGUARD_ALLOW_UNTESTED={key}"):
            check(key, old)
    monkeypatch.setenv("TRAINGUARD_ALLOW_UNTESTED_MEGATRON", "1")
    assert check("megatron-core", "0.20.0") is False


def test_a_replay_key_set_where_the_adapter_cannot_replay_is_refused_by_name():
    """recovery.replay_check / narrow_samples set true, and the adapter gave no replay (a megatron-core loop of yours
    without a Replayer): refused when the session is built -- with the guard or faults only -- naming each key, with
    the adapter's advice (its capabilities' HINTS: the core names no adapter); left at their defaults, the ladders
    act as written."""
    from megatron_hooks.capabilities import HINTS
    from trainguard.errors import ConfigError
    from trainguard.step.session import GuardSession

    block = {"recovery": {"replay_check": True, "narrow_samples": True}, "checks": {"enabled": False}}
    for enabled, hints in ((True, HINTS), (False, HINTS), (True, None)):
        with pytest.raises(ConfigError) as e:
            GuardSession(None, parse_block(block), 0, 1, guard_enabled=enabled, hints=hints)
        assert [p[0] for p in e.value.problems] == ["trainguard.recovery.replay_check",
                                                    "trainguard.recovery.narrow_samples"]
        assert ("replayer=Replayer" in str(e.value)) is (hints is not None)
    assert GuardSession(None, parse_block({}), 0, 1).guard.replays.replay is None  # (defaults: not refused)
    GuardSession(None, parse_block(block), 0, 1, replay=lambda mb, row: 1.0)


def test_under_the_zero_code_entry_a_refused_block_is_one_message_for_the_job(capsys, monkeypatch):
    """A block named inside the script (TrainingArguments(deepspeed=...)) is read only when the engine is built: a bad
    key was a traceback from every rank inside the framework's own output (a new user's trial, issue 53). Now the
    job's first rank says it once, and every rank exits 2 (the entry's wrapper over a stand-in deepspeed module)."""
    import types

    import ds_plugins.auto as auto

    def initialize(model=None, optimizer=None, config=None, **kwargs):
        return "DeepSpeed's own"
    ds = types.SimpleNamespace(initialize=initialize)
    auto._patch_deepspeed(ds)
    bad = {"train_micro_batch_size_per_gpu": 1, "trainguard": {"detectors": {"loss_spik": {}}}}
    for rank, says in (("0", True), ("1", False)):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as done:
            ds.initialize(model=object(), optimizer=object(), config=bad)
        assert done.value.code == 2
        err = capsys.readouterr().err
        assert ("[trainguard] the block is refused, nothing trained:" in err and "loss_spik" in err and
                "did you mean 'loss_spike'" in err) is says, err
    assert ds.initialize(model=object(), config={"train_micro_batch_size_per_gpu": 1}) == "DeepSpeed's own"


def test_under_your_accelerate_loop_a_refused_block_is_one_message_too(capsys, monkeypatch):
    """Your own Accelerate loop prepares its loader before the engine is built, and that is where the block is first
    read: a bad key there was a traceback from every rank through prepare_data_loader (a new user's trial of an
    Accelerate loop). Now the same one message, every rank exit 2 -- over a stand-in Accelerator whose DeepSpeed plugin
    holds the config, as Accelerate's does."""
    import types

    import ds_plugins.auto as auto

    class Accelerator:
        def __init__(self, config):
            self.state = types.SimpleNamespace(deepspeed_plugin=types.SimpleNamespace(deepspeed_config=config))

        def prepare_data_loader(self, data_loader, *args, **kwargs):
            return "Accelerate's own"
    auto._patch_accelerate(types.SimpleNamespace(Accelerator=Accelerator))
    bad = {"train_micro_batch_size_per_gpu": 1, "trainguard": {"detectors": {"loss_spik": {}}}}
    for rank, says in (("0", True), ("1", False)):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as done:
            Accelerator(bad).prepare_data_loader([1, 2])
        assert done.value.code == 2
        err = capsys.readouterr().err
        assert ("[trainguard] the block is refused, nothing trained:" in err and "loss_spik" in err) is says, err
    assert Accelerator({"train_micro_batch_size_per_gpu": 1}).prepare_data_loader([1]) == "Accelerate's own"
