import json
import os

import pytest
import torch

from trainguard.checkpoint import rng
from trainguard.checkpoint.async_writer import snapshot
from trainguard.checkpoint.fsio import atomic_write_json, sha256_file
from trainguard.checkpoint.health import CheckpointHealth, ResumeCheck
from trainguard.checkpoint.layout import CheckpointError, CheckpointLayout, step_tag, validate_tag
from trainguard.checkpoint.manifest import Manifest, hash_files, list_files, verify
from trainguard.checkpoint.retention import to_delete


@pytest.mark.parametrize("bad", ["../x", "a/b", "..", ".hidden", "", "a" * 200, "x\\y", "a b"])
def test_tags_are_validated(bad):
    with pytest.raises(CheckpointError):
        validate_tag(bad)


def test_good_tags():
    assert validate_tag("step00000012") == "step00000012" == step_tag(12)
    assert validate_tag("global_step7.final") == "global_step7.final"


def make_ckpt(root, tag, step, files):
    d = root / tag
    d.mkdir(parents=True)
    for rel, data in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(data)
    Manifest(tag=tag, step=step, files=hash_files(d, list_files(d))).write(d)
    return d


def test_verify_names_the_bad_file(tmp_path):
    d = make_ckpt(tmp_path, "t1", 1, {"a.pt": b"x" * 100, "trainguard/rank0.pt": b"y" * 10})
    assert verify(d).ok
    (d / "a.pt").write_bytes(b"x" * 99 + b"z")
    r = verify(d)
    assert not r.ok and r.bad_file == "a.pt" and "sha256" in r.reason
    assert verify(d, checksums=False).ok  # same size: only the checksum catches it
    (d / "a.pt").write_bytes(b"x" * 50)
    assert verify(d, checksums=False).bad_file == "a.pt"
    (d / "a.pt").unlink()
    assert verify(d).reason == "missing"
    d2 = make_ckpt(tmp_path, "t2", 2, {"a.pt": b"1"})
    (d2 / "intruder.pt").write_bytes(b"2")
    assert verify(d2).bad_file == "intruder.pt"
    (d2 / "manifest.json").unlink()
    assert verify(d2).bad_file == "manifest.json"


def test_layout_lists_only_committed_tags_by_step(tmp_path):
    make_ckpt(tmp_path, "b", 20, {"f": b"1"})
    make_ckpt(tmp_path, "a", 30, {"f": b"1"})
    (tmp_path / "torn").mkdir()
    (tmp_path / ".staging" / "x").mkdir(parents=True)
    lay = CheckpointLayout(tmp_path)
    assert lay.tags() == ["b", "a"]
    assert lay.latest() is None
    (tmp_path / "latest").write_text("../etc")
    assert lay.latest() is None


def test_retention_keeps_newest_and_newest_stable():
    tags = [f"s{i}" for i in range(1, 8)]
    assert to_delete(tags, stable={"s1", "s2", "s4"}, keep_last=2, keep_stable=2) == ["s1", "s3", "s5"]
    assert to_delete(tags, stable=set(), keep_last=3, keep_stable=2) == ["s1", "s2", "s3", "s4"]
    assert to_delete(["s1"], stable=set(), keep_last=1, keep_stable=0) == []


def test_health_marks_stable_only_after_quiet_steps_and_records_the_trajectory():
    h = CheckpointHealth(stable_after=3, verify_steps=2)
    h.saved("a", 10)
    assert h.on_step(11, 1.0, False) == []
    assert h.on_step(12, 0.9, False) == [("trajectory", "a", {11: 1.0, 12: 0.9})]
    assert h.on_step(13, 0.8, False) == [("stable", "a", 13)]
    h.saved("b", 20)
    h.on_step(21, 1.0, True)  # an anomaly right after: never stable
    assert h.on_step(22, 1.0, False) == [("trajectory", "b", {21: 1.0, 22: 1.0})]
    assert all(a[0] != "stable" for s in range(23, 40) for a in h.on_step(s, 1.0, False))


def test_resume_check():
    c = ResumeCheck("t", {5: 1.0, 6: 2.0}, rtol=1e-3)
    assert c.on_step(5, 1.0) is None
    r = c.on_step(6, 2.0001)
    assert r["ok"] and r["max_rel_diff"] == pytest.approx(5e-5)
    bad = ResumeCheck("t", {5: 1.0}, rtol=1e-3).on_step(5, 1.5)
    assert not bad["ok"] and bad["max_rel_diff"] == pytest.approx(0.5)


def test_rng_round_trip_through_a_weights_only_file(tmp_path):
    import random

    import numpy as np

    state = rng.capture()
    torch.save(state, tmp_path / "r.pt")
    a = (random.random(), float(np.random.rand()), torch.rand(1).item())
    rng.restore(torch.load(tmp_path / "r.pt", weights_only=True))
    assert (random.random(), float(np.random.rand()), torch.rand(1).item()) == a


def test_atomic_write_and_permissions(tmp_path):
    atomic_write_json(tmp_path / "m.json", {"a": 1})
    assert json.loads((tmp_path / "m.json").read_text()) == {"a": 1}
    from trainguard.checkpoint.fsio import UMASK

    assert os.stat(tmp_path / "m.json").st_mode & 0o777 == 0o666 & ~UMASK  # the user's umask, not a fixed 0644
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    digest, size = sha256_file(tmp_path / "m.json")
    assert size == (tmp_path / "m.json").stat().st_size and len(digest) == 64


def test_snapshot_is_a_detached_cpu_copy():
    t = torch.ones(3, requires_grad=True)
    s = snapshot({"w": t, "nested": [t, (t, 1)], "n": 5})
    t.data.add_(1)
    assert s["w"].tolist() == [1.0, 1.0, 1.0] and not s["w"].requires_grad
    assert s["nested"][1][1] == 1 and s["n"] == 5


def test_rollback_choice_names_every_invalid_checkpoint_it_passed_over(tmp_path):
    """Newest first: 30 (valid, not stable), 20 (corrupt), 10 (valid, stable) -> 10 is chosen, and 20
    is reported although the newer 30 verified."""
    from trainguard.checkpoint.layout import STABLE
    from trainguard.checkpoint.manifest import Manifest, hash_files, list_files
    from trainguard.checkpoint.rollback import choose_rollback

    for step in (10, 20, 30):
        d = tmp_path / f"step{step:08d}"
        d.mkdir()
        (d / "weights.pt").write_bytes(b"x" * 256)
        Manifest(tag=d.name, step=step, files=hash_files(d, list_files(d))).write(d)
    (tmp_path / "step00000010" / STABLE).write_text("{}")
    (tmp_path / "step00000020" / "weights.pt").write_bytes(b"y" * 256)
    tag, why, bad = choose_rollback(tmp_path, onset=35, mode="stable")
    assert tag == "step00000010" and "stable" in why and [b["tag"] for b in bad] == ["step00000020"]
    tag, _, bad = choose_rollback(tmp_path, onset=35, mode="latest_valid")
    assert tag == "step00000030" and bad == []


def test_checkpoints_of_another_precision_are_no_rollback_target(tmp_path):
    """fp16 at 4 and 8, then a bf16 fallback, bf16 at 12: a bf16 run may roll back to 12 or later
    only (the distributed optimizer's fp16 snapshots do not load into it); an fp16 run to any."""
    from trainguard.checkpoint.manifest import Manifest, hash_files, list_files
    from trainguard.checkpoint.rollback import choose_rollback, fitting_after

    for step, precision in ((4, "fp16"), (8, "fp16"), (12, "bf16")):
        d = tmp_path / f"step{step:08d}"
        d.mkdir()
        (d / "weights.pt").write_bytes(b"x" * 64)
        Manifest(tag=d.name, step=step, files=hash_files(d, list_files(d)), layout={"precision": precision}).write(d)
    assert fitting_after(tmp_path, "precision", "bf16") == 9
    assert fitting_after(tmp_path, "precision", "fp16") == 13
    assert fitting_after(tmp_path, "framework", "megatron-core") == 0  # (not said: fits)
    tag, _, _ = choose_rollback(tmp_path, onset=20, mode="latest_valid", not_before=9)
    assert tag == "step00000012"
    tag, why, _ = choose_rollback(tmp_path, onset=11, mode="latest_valid", not_before=9)
    assert tag is None and "predates step 11" in why


class _Guard:
    faults = None

    def __init__(self):
        self.records = []

    def emit(self, step, record, ranks, action, detail, **kw):
        self.records.append((step, record, detail))

    def new_run(self):  # (no log here to set aside)
        return None

    def of(self, record):
        return [d for _, r, d in self.records if r is record]


def _manager(cfg_block, at=0):
    """A CheckpointManager whose framework part only moves the step: enough for the resume's choices."""
    from trainguard.checkpoint.manager import CheckpointManager
    from trainguard.config import parse_block

    class Manager(CheckpointManager):
        def step_count(self):
            return self.at

        def load(self, root, tag=None, mode="latest_valid", purpose="resume", **kw):
            chosen, _ = self.choose_for_load(root, tag, mode)
            self.resumed_tag = chosen
            if chosen:
                self.at = int(chosen[4:])
            return chosen

    m = Manager(parse_block({"checkpoint": cfg_block}), _Guard(), heart=None, state=None, faults=None, goodput=None)
    m.at = at
    return m


def _two(root):
    """Two committed, verified, not stable checkpoints (steps 10 and 20)."""
    from trainguard.checkpoint.manifest import Manifest, hash_files, list_files

    for step in (10, 20):
        d = root / f"step{step:08d}"
        d.mkdir(parents=True)
        (d / "weights.bin").write_bytes(b"w" * step)
        Manifest(tag=d.name, step=step, files=hash_files(d, list_files(d))).write(d)
    return root


def _listing(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_a_resume_that_finds_checkpoints_but_loads_none_stops_and_moves_nothing(tmp_path, monkeypatch):
    """Issue 25 item 1: resume "stable" over checkpoints none of which is stable, or an authenticated run
    whose key was rotated (or just turned on), started from step 0 and moved every checkpoint to
    .abandoned/ with one warning. Now it stops with an error naming each checkpoint and why, and not one
    file moves. (Seen failing on the code before: resume_on_start returned None and the listing changed.)"""
    from trainguard.checkpoint.layout import CheckpointError
    from trainguard.events import Record

    root = _two(tmp_path / "stable")
    before = _listing(root)
    m = _manager({"dir": str(root), "resume": "stable"})
    with pytest.raises(CheckpointError) as e:
        m.resume_on_start()
    msg = str(e.value)
    assert "none can be loaded" in msg and "step00000010: not stable" in msg and "step00000020: not stable" in msg
    assert 'resume to "latest_valid"' in msg and _listing(root) == before
    assert not m.guard.of(Record.RESUME_SKIPPED) and not m.guard.of(Record.FRESH_START)

    # authentication turned on (or the key rotated) for checkpoints signed with no key or another one
    root = _two(tmp_path / "auth")
    before = _listing(root)
    monkeypatch.setenv("TG_ROTATED", "a-new-key-0123456789")
    m = _manager({"dir": str(root), "hmac_key_env": "TG_ROTATED"})
    with pytest.raises(CheckpointError) as e:
        m.resume_on_start()
    assert "step00000020: manifest.hmac: unauthenticated" in str(e.value) and _listing(root) == before
    assert [d["tag"] for d in m.guard.of(Record.CHECKPOINT_INVALID)] == ["step00000020", "step00000010"]

    # the default resume loads the newest: no error, nothing set aside
    m = _manager({"dir": str(_two(tmp_path / "latest"))})
    assert m.resume_on_start() == "step00000020" and not m.guard.of(Record.FRESH_START)

    # ... also when the framework loaded its own checkpoint first (Megatron-LM's --load, newer_than): the newer
    # ones all refused for a rotated key used to go to .abandoned/ and the run went on from the older step (issue 35
    # item 4)
    root = _two(tmp_path / "auth_load")
    before = _listing(root)
    m = _manager({"dir": str(root), "hmac_key_env": "TG_ROTATED"}, at=5)
    with pytest.raises(CheckpointError) as e:
        m.resume_on_start(newer_than=5)
    assert "loaded its own checkpoint (step 5)" in str(e.value) and "unauthenticated" in str(e.value)
    assert _listing(root) == before

    # the framework loaded its own checkpoint first (Megatron-LM's --load): only a newer snapshot loads,
    # and none newer is no failure (the run did resume)
    for newer_than, loaded in ((15, "step00000020"), (20, None), (25, None)):
        m = _manager({"dir": str(_two(tmp_path / f"n{newer_than}"))}, at=newer_than)
        assert m.resume_on_start(newer_than=newer_than) == loaded
        skipped = m.guard.of(Record.RESUME_SKIPPED)
        if loaded is None:
            (d,) = skipped
            assert f"newer than step {newer_than}" in d["reason"]
        else:
            assert not skipped


def test_a_missing_or_foreign_checkpoint_dir_is_a_record_at_first_and_a_stop_on_a_restart(tmp_path, monkeypatch):
    """Issue 25 item 1: a checkpoint.dir that is missing or unmounted gave no record at all, and the next
    save created it. A first attempt now says so (fresh_start, created); a restarted attempt (torchrun's
    or Slurm's count) whose directory lacks the run marker the first attempt wrote stops."""
    from trainguard.checkpoint.layout import CheckpointError
    from trainguard.checkpoint.runid import RUN_ID
    from trainguard.events import Record

    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    root = tmp_path / "ck"
    m = _manager({"dir": str(root)})
    assert m.resume_on_start() is None
    (d,) = m.guard.of(Record.FRESH_START)
    assert d["created"] is True and d["attempt"] == 0 and (root / RUN_ID).is_file()

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert _manager({"dir": str(root)}).resume_on_start() is None  # its own dir, no save yet: fine
    for where in (tmp_path / "unmounted", tmp_path / "empty"):
        if where.name == "empty":
            where.mkdir()
        with pytest.raises(CheckpointError) as e:
            _manager({"dir": str(where)}).resume_on_start()
        assert "restarted attempt 1" in str(e.value) and str(where) in str(e.value)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    with pytest.raises(CheckpointError, match="restarted attempt 2"):
        _manager({"dir": str(tmp_path / "requeued")}).resume_on_start()


def test_resume_none_is_the_explicit_fresh_start_and_sets_the_old_checkpoints_aside(tmp_path):
    """Issue 15 item 4 / issue 25 item 1: a fresh start over existing checkpoints is resume "none", by
    choice; they are moved to .abandoned/ (kept, out of the listing), so a save at step 10 replaces none."""
    from trainguard.checkpoint.layout import CheckpointLayout
    from trainguard.events import Record

    root = _two(tmp_path / "ck")
    m = _manager({"dir": str(root), "resume": "none"})
    assert m.resume_on_start() is None
    (d,) = m.guard.of(Record.FRESH_START)
    assert d["set_aside"] == ["step00000010", "step00000020"] and "none" in d["reason"]
    assert CheckpointLayout(root).tags() == []
    kept = sorted(p.name.split(".")[0] for p in (root / ".abandoned").iterdir())
    assert kept == ["step00000010", "step00000020"]


def test_a_crash_between_the_renames_of_a_resave_loses_nothing(tmp_path, monkeypatch):
    """Issue 25 item 2: saving a tag again moves the old copy aside, then renames the new one in; a crash
    between the two left neither in place, and the next start deleted .staging holding the old one."""
    import os as _os
    from pathlib import Path

    from trainguard.checkpoint import commit as commit_mod
    from trainguard.checkpoint.manifest import Manifest, hash_files, list_files, verify

    root = _two(tmp_path / "ck")
    staged_root = root / ".staging" / "n1"
    d = staged_root / "step00000020"
    d.mkdir(parents=True)
    (d / "weights.bin").write_bytes(b"new" * 7)
    real_replace = _os.replace

    def crash_on_second(src, dst):  # the old copy goes aside, then the process dies
        if Path(src) == d:
            raise KeyboardInterrupt("killed between the renames")
        return real_replace(src, dst)

    monkeypatch.setattr(commit_mod.os, "replace", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        commit_mod.commit_staged(root, staged_root, "n1", Manifest(tag=d.name, step=20,
                                                                   files=hash_files(d, list_files(d))))
    monkeypatch.setattr(commit_mod.os, "replace", real_replace)
    assert not (root / "step00000020").exists()  # the window the issue describes
    m = _manager({"dir": str(root)})
    assert m.resume_on_start() == "step00000020"  # put back, verified, loaded
    assert verify(root / "step00000020").ok and not (root / ".staging").exists()
    assert (root / "step00000020" / "weights.bin").read_bytes() == b"w" * 20  # the committed (old) copy


def _committed(root, name, step, files=None):
    from trainguard.checkpoint.manifest import Manifest, hash_files, list_files

    d = root / name
    d.mkdir(parents=True)
    (d / "weights.bin").write_bytes(b"w" * (step + 1))
    Manifest(tag=name, step=step, files=files or hash_files(d, list_files(d))).write(d)
    return d


def test_manifest_entries_outside_the_checkpoint_are_refused_unread(tmp_path):
    """Issue 15 item 12: an absolute or '..' manifest entry used to be read from outside the checkpoint."""
    from trainguard.checkpoint.manifest import sha256_file, verify

    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"s")
    digest, _ = sha256_file(secret)
    for rel in (str(secret), "../secret.bin", "a/../../secret.bin"):
        root = tmp_path / f"ck{abs(hash(rel))}"
        d = _committed(root, "step00000001", 1)
        from trainguard.checkpoint.manifest import Manifest

        man = Manifest.read(d)
        man.files[rel] = {"size": 1, "sha256": digest}
        man.write(d)
        res = verify(d)
        assert not res.ok and res.bad_file == rel and "outside the checkpoint" in res.reason


def test_a_directory_with_an_invalid_tag_name_is_passed_over_not_fatal(tmp_path):
    """Issue 15 item 12: a committed-looking directory named 'bad tag!' crashed rollback, retention and
    resume on rank 0 (CheckpointError from tag_dir) while the other ranks waited."""
    from trainguard.checkpoint.layout import CheckpointLayout
    from trainguard.checkpoint.rollback import choose_rollback

    root = tmp_path / "ck"
    _committed(root, "step00000004", 4)
    _committed(root, "bad tag!", 9)
    layout = CheckpointLayout(root)
    assert layout.tags() == ["step00000004"] and layout.invalid_names == ["bad tag!"]
    tag, _, bad = choose_rollback(root, onset=10, mode="latest_valid")
    assert tag == "step00000004" and bad[0]["tag"] == "bad tag!" and "not a valid tag" in bad[0]["reason"]


def test_ckpt_cli_turns_checkpoint_errors_into_exit_1(tmp_path, capsys):
    from trainguard.cli import main

    _committed(tmp_path / "ck", "step00000001", 1)
    assert main(["ckpt", "inspect", str(tmp_path / "ck"), "../etc"]) == 1
    err = capsys.readouterr().err
    assert "invalid checkpoint tag" in err and "Traceback" not in err


def test_authenticated_checkpoints_refuse_unsigned_or_altered_ones_before_opening_a_file(tmp_path, monkeypatch):
    """Issue 15 item 11: with checkpoint.hmac_key_env, commits are signed and a checkpoint without a
    valid HMAC is refused by the resume's choice (which runs before any pickle is opened), naming the
    file; a tampered file whose sha256 the attacker rewrote in the manifest is caught by the HMAC."""
    import json as _json

    from trainguard.checkpoint.commit import commit_staged
    from trainguard.checkpoint.manager import CheckpointManager
    from trainguard.checkpoint.manifest import Manifest, hash_files, list_files
    from trainguard.cli import main
    from trainguard.config import ConfigError, parse_block

    cfg = parse_block({"checkpoint": {"dir": str(tmp_path / "ck"), "hmac_key_env": "TG_TEST_KEY"}})

    class Manager(CheckpointManager):
        def step_count(self):
            return 0

    monkeypatch.delenv("TG_TEST_KEY", raising=False)
    with pytest.raises(ConfigError, match="TG_TEST_KEY"):  # configured, but no key: the run does not start
        Manager(cfg, None, heart=None, state=None, faults=None, goodput=None)
    monkeypatch.setenv("TG_TEST_KEY", "s3cret-0123456789")
    m = Manager(cfg, None, heart=None, state=None, faults=None, goodput=None)

    def save(step, key):
        staging = tmp_path / "ck" / ".staging" / f"n{step}"
        staged = staging / f"step{step:08d}"
        staged.mkdir(parents=True)
        (staged / "model.pt").write_bytes(b"weights %d" % step)
        commit_staged(tmp_path / "ck", staging, f"n{step}", Manifest(
            tag=staged.name, step=step, files=hash_files(staged, list_files(staged))), key=key)

    save(10, m.key)
    save(20, None)  # unsigned
    tag, skipped, _ = m.choose(tmp_path / "ck", "latest_valid")
    assert tag == "step00000010"
    assert skipped[0]["tag"] == "step00000020" and skipped[0]["bad_file"] == "manifest.hmac"
    assert "unauthenticated" in skipped[0]["reason"]
    # tamper with step 10: new bytes, the manifest's sha256 and size rewritten to match
    d = tmp_path / "ck" / "step00000010"
    (d / "model.pt").write_bytes(b"import os; os.system('evil')")
    man = _json.loads((d / "manifest.json").read_text())
    man["files"] = hash_files(d, ["model.pt"])
    (d / "manifest.json").write_text(_json.dumps(man))
    tag, skipped, _ = m.choose(tmp_path / "ck", "latest_valid")
    assert tag is None and {s["bad_file"] for s in skipped} == {"manifest.hmac"}
    assert any("HMAC mismatch" in s["reason"] for s in skipped)
    # without a key configured the same directory verifies (sha256 only: rot, not tampering)
    assert Manager(parse_block({"checkpoint": {"dir": str(tmp_path / "ck")}}), None, heart=None, state=None, faults=None, goodput=None).choose(
        tmp_path / "ck", "latest_valid")[0] == "step00000020"
    assert main(["ckpt", "verify", str(tmp_path / "ck"), "--key-env", "TG_TEST_KEY"]) == 1


def test_ckpt_list_verify_inspect_on_a_committed_checkpoint(tmp_path, capsys):
    from trainguard.cli import main

    _committed(tmp_path / "ck", "step00000007", 7)
    assert main(["ckpt", "list", str(tmp_path / "ck")]) == 0 and "step00000007" in capsys.readouterr().out
    assert main(["ckpt", "verify", str(tmp_path / "ck")]) == 0
    capsys.readouterr()
    assert main(["ckpt", "inspect", str(tmp_path / "ck"), "step00000007"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["step"] == 7 and shown["files"] == {"weights.bin": 8} and shown["stable"] is None
    (tmp_path / "ck" / "step00000007" / "weights.bin").write_bytes(b"x" * 8)  # same size, other bytes
    assert main(["ckpt", "verify", str(tmp_path / "ck")]) == 1 and "sha256" in capsys.readouterr().out


def test_ckpt_diff_of_something_that_is_not_a_checkpoint_is_exit_1_naming_it(tmp_path, capsys):
    from trainguard.cli import main

    _committed(tmp_path / "ck", "step00000007", 7)
    (tmp_path / "nothing").mkdir()
    assert main(["ckpt", "diff", str(tmp_path / "ck" / "step00000007"), str(tmp_path / "nothing")]) == 1
    err = capsys.readouterr().err
    assert "nothing" in err and "not a committed checkpoint" in err and "Traceback" not in err
    # the same checkpoint twice: nothing changed
    assert main(["ckpt", "diff", str(tmp_path / "ck" / "step00000007"), str(tmp_path / "ck" / "step00000007")]) == 0
    out = capsys.readouterr().out
    assert "steps between: 0" in out and "lineage: unchanged" in out and "quarantined samples added: 0" in out


def test_report_summary_of_an_aborted_run():
    from trainguard.observe.summary import summarize

    lines = [{"type": "metric", "step": 5, "goodput": 0.9},
             {"type": "event", "step": 6, "event": "nonfinite", "ranks": [1], "action": "skip_step",
              "detail": {"per_rank": {"1": {"sample_ids": [11, 12]}}}},
             {"type": "event", "step": 7, "event": "rollback", "ranks": [1], "action": "rollback",
              "detail": {"to_step": 4, "quarantined": {"1": [12]}}},
             {"type": "event", "step": 9, "event": "abort", "ranks": [1], "action": "abort",
              "detail": {"reason": "rollback budget exhausted"}}]
    text = summarize(lines).splitlines()
    assert text[0].startswith("trainguard summary: ABORTED; last step 9; goodput 0.900")
    assert any(x.strip().startswith("nonfinite") and "ranks [1]" in x and "samples [11, 12]" in x for x in text)
    assert any("7->4" in x for x in text) and text[-1] == "abort reason: rollback budget exhausted"


def test_ckpt_sign_turns_authentication_on_for_an_existing_run(tmp_path, monkeypatch, capsys):
    """Issue 25 items 1 and 10: `trainguard ckpt sign DIR --key-env VAR` signs verified checkpoints (so a job
    that turns checkpoint.hmac_key_env on resumes from them); a corrupt one is never signed; `ckpt list` and
    `verify` without a key say "unsigned" instead of a bare OK."""
    import json as _json

    from trainguard.checkpoint.auth import problem
    from trainguard.cli import main

    root = _two(tmp_path / "ck")
    (root / "step00000010" / "weights.bin").write_bytes(b"x" * 10)  # rot: same size, other bytes
    assert main(["ckpt", "verify", str(root), "step00000020"]) == 0
    assert "unsigned" in capsys.readouterr().out
    monkeypatch.setenv("TG_SIGN_KEY", "key-one-0123456789")
    assert main(["ckpt", "sign", str(root), "--key-env", "TG_SIGN_KEY"]) == 1  # one could not be signed
    out = capsys.readouterr().out
    assert "step00000010: NOT SIGNED" in out and "sha256 mismatch" in out and "step00000020: signed" in out
    assert problem(root / "step00000020", b"key-one-0123456789") is None and problem(root / "step00000010", b"key-one-0123456789") is not None
    m = _manager({"dir": str(root), "hmac_key_env": "TG_SIGN_KEY"})
    assert m.resume_on_start() == "step00000020"
    monkeypatch.setenv("TG_SIGN_KEY", "key-two-0123456789")  # another key: a rotation, verified with the old key
    assert main(["ckpt", "sign", str(root), "step00000020", "--key-env", "TG_SIGN_KEY"]) == 1
    assert "another key" in capsys.readouterr().out
    monkeypatch.setenv("TG_OLD_KEY", "key-one-0123456789")
    # issue 54 probe 5: a payload planted with a manifest rewritten to match is never signed under the new key
    d = root / "step00000020"
    good = {p: p.read_bytes() for p in d.rglob("*") if p.is_file()}
    (d / "weights.bin").write_bytes(b"a pickle that runs code")
    man = _json.loads((d / "manifest.json").read_text())
    man["files"] = hash_files(d, list_files(d))
    (d / "manifest.json").write_text(_json.dumps(man))
    assert main(["ckpt", "sign", str(root), "step00000020", "--key-env", "TG_SIGN_KEY", "--old-key-env",
                 "TG_OLD_KEY"]) == 1
    assert "NOT SIGNED" in capsys.readouterr().out and problem(d, b"key-two-0123456789") is not None
    for path, data in good.items():  # (the checkpoint as signed with the old key)
        path.write_bytes(data)
    assert main(["ckpt", "sign", str(root), "step00000020", "--key-env", "TG_SIGN_KEY", "--old-key-env",
                 "TG_OLD_KEY"]) == 0
    assert main(["ckpt", "verify", str(root), "step00000020", "--key-env", "TG_SIGN_KEY"]) == 0
    assert "signature valid" in capsys.readouterr().out


def test_a_malformed_or_crafted_checkpoint_is_invalid_with_a_reason_never_an_exception_or_a_hang(tmp_path):
    """Issue 25 items 9 and 6: a non-ASCII signature raised TypeError, '"files": []' AttributeError, a FIFO
    listed as a file blocked rank 0 in its read (the other ranks then hang in the broadcast); unlisted
    dotfiles and '*.tmp' files, and symlinks, passed verification while a loader may open them."""
    import threading

    from trainguard.checkpoint.auth import sign
    from trainguard.checkpoint.manifest import Manifest, sha256_file

    def fresh(name):
        return _committed(tmp_path / name, "step00000001", 1)

    cases = {}
    d = fresh("sig")
    sign(d, b"k")
    (d / "manifest.hmac").write_bytes("é0f".encode())
    cases["sig"] = (d, b"k", "HMAC mismatch")
    d = fresh("sigbin")
    (d / "manifest.hmac").write_bytes(b"\xff\xfe")
    cases["sigbin"] = (d, b"k", "HMAC mismatch")
    d = fresh("empty")
    man = Manifest.read(d).to_json()
    man["files"] = []
    (d / "manifest.json").write_text(json.dumps(man))
    cases["empty"] = (d, None, "non-empty mapping")
    d = fresh("list")
    (d / "manifest.json").write_text("[1, 2]")
    cases["list"] = (d, None, "manifest")
    d = fresh("entry")
    man = Manifest.read(d).to_json()
    man["files"]["weights.bin"] = "x"
    (d / "manifest.json").write_text(json.dumps(man))
    cases["entry"] = (d, None, "entry 'weights.bin'")
    d = fresh("fifo")
    os.mkfifo(d / "pipe.bin")
    man = Manifest.read(d).to_json()
    man["files"]["pipe.bin"] = {"size": 0, "sha256": "0" * 64}
    (d / "manifest.json").write_text(json.dumps(man))
    cases["fifo"] = (d, None, "not a regular file")
    d = fresh("link")
    (tmp_path / "elsewhere.bin").write_bytes(b"w" * 2)
    (d / "weights.bin").unlink()
    (d / "weights.bin").symlink_to(tmp_path / "elsewhere.bin")
    cases["link"] = (d, None, "not a regular file")
    d = fresh("linkdir")
    (tmp_path / "outside").mkdir()
    (d / "sub").symlink_to(tmp_path / "outside")
    cases["linkdir"] = (d, None, "not a regular file")
    for extra in (".hidden", "mp_rank_01_model_states.pt.tmp", ".metadata"):
        d = fresh(f"extra{extra}")
        (d / extra).write_bytes(b"pickle")
        cases[f"extra{extra}"] = (d, None, "file not in the manifest")

    results = {}

    def run():
        for name, (d, key, _) in cases.items():
            results[name] = verify(d, key=key)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), f"verify blocked (done: {sorted(results)})"
    for name, (d, key, why) in cases.items():
        res = results[name]
        assert not res.ok and why in res.reason, (name, res)
    # a dotfile a framework writes (dist_checkpointing's .metadata) is hashed, so it verifies
    d = tmp_path / "dist" / "step00000002"
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(b"pickle")
    (d / "w.distcp").write_bytes(b"w")
    assert ".metadata" in list_files(d)
    Manifest(tag=d.name, step=2, files=hash_files(d, list_files(d))).write(d)
    assert verify(d).ok
    (d / ".metadata").write_bytes(b"pickl3")
    assert verify(d).bad_file == ".metadata"
    assert sha256_file(d / "w.distcp")[1] == 1


def test_each_rank_loads_only_bytes_that_match_the_manifest_rank_0_verified(tmp_path):
    """Issue 25 item 7: rank 0 hashed the files when it chose the checkpoint and every rank reopened them by
    path later: a file swapped in between was loaded unseen. VerifiedReader (every adapter's loads go through it,
    trainguard.checkpoint.verified_io) pins the manifest rank 0 verified by its digest, then hands over only
    bytes it read once and matched against it."""
    from trainguard.checkpoint.auth import sign
    from trainguard.checkpoint.reader import VerifiedReader, manifest_digest

    d = _committed(tmp_path / "ck", "step00000001", 1)
    sign(d, b"k")
    digest = manifest_digest(d)
    reader = VerifiedReader(d, digest, key=b"k")
    assert reader.read(d / "weights.bin") == b"w" * 2 and reader.read_files == ["weights.bin"]
    (d / "weights.bin").write_bytes(b"x" * 2)  # swapped after rank 0's verify: same size, other bytes
    with pytest.raises(CheckpointError, match="differ from the manifest"):
        reader.read(d / "weights.bin")
    (d / "extra.pt").write_bytes(b"pickle")
    with pytest.raises(CheckpointError, match="not listed"):
        reader.read(d / "extra.pt")
    with pytest.raises(CheckpointError, match="not listed"):
        reader.read(tmp_path / "ck" / "other" / "x.pt")
    (d / "weights.bin").unlink()
    (d / "weights.bin").symlink_to(tmp_path / "ck" / "step00000001" / "extra.pt")
    with pytest.raises(OSError):  # O_NOFOLLOW: a symlink is never followed
        reader.read(d / "weights.bin")
    man = json.loads((d / "manifest.json").read_text())
    man["step"] = 2
    (d / "manifest.json").write_text(json.dumps(man))  # the manifest itself changed after rank 0 verified it
    with pytest.raises(CheckpointError, match="changed since it was verified"):
        VerifiedReader(d, digest, key=b"k")
    with pytest.raises(CheckpointError, match="HMAC mismatch"):
        VerifiedReader(d, None, key=b"k")


def test_a_frameworks_own_loads_deserialise_only_verified_bytes(tmp_path):
    """Issue 25 item 7 on the loaders that open files themselves: megatron's dist_checkpointing (through
    torch.distributed.checkpoint's file streams: a pickled .metadata, the .distcp tensors) and DeepSpeed's
    torch.load of each file (a universal conversion's per-parameter files too). Under verified_reads a file
    swapped after rank 0's check is refused, never deserialised; an unlisted one is never read. Without it
    (before the fix, for megatron and the universal conversion) the swapped tensor loads unseen."""
    import shutil

    import torch.distributed.checkpoint as dcp

    from trainguard.checkpoint.manifest import Manifest, hash_files, list_files

    from trainguard.checkpoint.reader import VerifiedReader, manifest_digest
    from trainguard.checkpoint.verified_io import verified_reads

    d = tmp_path / "ck" / "step00000010"
    dcp.save({"w": torch.arange(6.0)}, checkpoint_id=str(d / "dist"), no_dist=True)
    torch.save({"rng": 7}, d / "side.pt")
    Manifest(tag=d.name, step=10, files=hash_files(d, list_files(d))).write(d)
    digest = manifest_digest(d)
    reader = VerifiedReader(d, digest)
    out = {"w": torch.zeros(6)}
    with verified_reads(reader):
        dcp.load(out, checkpoint_id=str(d / "dist"), no_dist=True)
        assert torch.load(d / "side.pt", weights_only=True) == {"rng": 7}
    assert torch.equal(out["w"], torch.arange(6.0))
    assert {"dist/.metadata", "side.pt"} <= set(reader.read_files)
    assert any(f.endswith(".distcp") for f in reader.read_files)
    assert torch.load.__module__.startswith("torch")  # (the patch is gone after the context)

    other = tmp_path / "other"  # the same tensor's file with other values swapped in after the check
    dcp.save({"w": torch.full((6,), 66.0)}, checkpoint_id=str(other), no_dist=True)
    (distcp,) = [f for f in (d / "dist").iterdir() if f.suffix == ".distcp"]
    shutil.copyfile(other / distcp.name, distcp)
    with pytest.raises(CheckpointError, match="differ from the manifest"), verified_reads(VerifiedReader(d, digest)):
        dcp.load({"w": torch.zeros(6)}, checkpoint_id=str(d / "dist"), no_dist=True)
    unchecked = {"w": torch.zeros(6)}
    dcp.load(unchecked, checkpoint_id=str(d / "dist"), no_dist=True)
    assert unchecked["w"][0] == 66.0  # (what a load without the check takes in)
    torch.save({"evil": 1}, d / "extra.pt")
    with pytest.raises(CheckpointError, match="not listed"), verified_reads(VerifiedReader(d, digest)):
        torch.load(d / "extra.pt", weights_only=True)
    torch.save({"fine": 1}, tmp_path / "elsewhere.pt")
    with verified_reads(VerifiedReader(d, digest)):  # files outside the checkpoint's folder pass through
        assert torch.load(tmp_path / "elsewhere.pt", weights_only=True) == {"fine": 1}


def test_validate_never_imports_the_plugins_a_block_names_and_ckpt_diff_refuses_an_old_torch(tmp_path, monkeypatch):
    """Issue 25 item 10: callbacks and plugins named by import path are code; `trainguard validate` must check a
    block without running it. `ckpt diff` reads sidecars with weights_only=True, safe only from torch 2.6."""
    import sys

    from trainguard.checkpoint import diff as diff_mod
    from trainguard.cli import main

    marker = tmp_path / "ran"
    (tmp_path / "evil_tg_plugin.py").write_text(f"open({str(marker)!r}, 'w').write('x')\ndef f(r): pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"trainguard": {"callbacks": ["evil_tg_plugin:f"],
                                              "detectors": {"custom": [{"type": "evil_tg_plugin:f"}]}}}))
    assert main(["validate", str(cfg)]) == 0
    assert not marker.exists() and "evil_tg_plugin" not in sys.modules
    d = _committed(tmp_path / "ck", "step00000001", 1)
    monkeypatch.setattr(diff_mod.torch, "__version__", "2.5.1")
    with pytest.raises(CheckpointError, match="safe only from torch 2.6"):
        diff_mod.read_side(d)


def test_the_trainers_resume_fails_closed_when_none_of_trainguards_checkpoints_verifies(tmp_path):
    """Issue 25 item 1 under HF's Trainer: when no checkpoint-N verified, trainguard's choice was None and HF
    started afresh -- its saves and checkpoint rotation then replace the run's checkpoints. Now it stops, naming
    each; with one that verifies it is chosen past the torn newer one; with none of trainguard's, HF decides."""
    from trainguard.checkpoint.resume import newest_resumable_folder as _verified_hf_checkpoint

    out = tmp_path / "out"
    _committed(out / "checkpoint-10", "global_step10", 10)
    _committed(out / "checkpoint-20", "global_step20", 20)
    (out / "checkpoint-20" / "global_step20" / "weights.bin").write_bytes(b"torn")
    assert _verified_hf_checkpoint(str(out), "latest_valid") == str(out / "checkpoint-10")
    (out / "checkpoint-10" / "global_step10" / "weights.bin").write_bytes(b"t")
    with pytest.raises(CheckpointError) as e:
        _verified_hf_checkpoint(str(out), "latest_valid")
    assert "checkpoint-20/global_step20: weights.bin" in str(e.value) and "checkpoint-10/global_step10" in str(e.value)
    with pytest.raises(CheckpointError, match="manifest.hmac"):  # a key turned on for unsigned checkpoints
        _committed(out / "checkpoint-30", "global_step30", 30)
        _verified_hf_checkpoint(str(out), "latest_valid", key=b"k")
    assert _verified_hf_checkpoint(str(tmp_path / "nothing"), "latest_valid") is None
    (tmp_path / "hf-only" / "checkpoint-5").mkdir(parents=True)  # HF's own checkpoint, no manifest: HF decides
    assert _verified_hf_checkpoint(str(tmp_path / "hf-only"), "latest_valid") is None


def test_a_checkpoint_of_an_older_trainguard_still_loads_with_the_guarantee_it_had(tmp_path):
    """Format 1 manifests (before every file was listed) left dotfiles and *.tmp out by design: after an upgrade
    they still verify -- a run is never stopped for its own older checkpoints -- while a format-2 one with the
    same unlisted .metadata does not."""
    from trainguard.checkpoint.manifest import Manifest

    for fmt, ok in ((1, True), (2, False)):
        d = tmp_path / f"f{fmt}" / "step00000001"
        d.mkdir(parents=True)
        (d / "w.distcp").write_bytes(b"w")
        Manifest(tag=d.name, step=1, files=hash_files(d, ["w.distcp"]), format=fmt).write(d)
        (d / ".metadata").write_bytes(b"pickle")
        assert verify(d).ok is ok


def test_hashing_a_large_checkpoint_beats_the_heartbeat_from_the_training_thread_only(tmp_path, monkeypatch):
    """Issue 35 item 6: hashing and verifying sent no heartbeat, so a checkpoint that takes longer than
    hang_timeout_s to hash looked like a hang to the watchdog (every rank exits 75, the restart verifies again: a
    loop). Each chunk now beats the heartbeat in the rank's phase -- from the training thread only."""
    import threading
    import time as _time

    from trainguard.checkpoint import fsio
    from trainguard.checkpoint.manager import CheckpointManager
    from trainguard.config import parse_block
    from trainguard.liveness.watchdog import Heartbeat, find_hung

    heart = Heartbeat(0)
    heart.beat("checkpoint", 7)
    CheckpointManager(parse_block({}), None, heart, None, None, None)
    big = tmp_path / "shard.pt"
    big.write_bytes(b"x" * (64 << 10))
    started = _time.time()
    slow = lambda: _time.sleep(0.05)  # noqa: E731  -- a slow disk: 16 chunks, ~0.8 s
    monkeypatch.setattr(fsio, "_progress", (lambda inner: (lambda: (slow(), inner())))(fsio._progress))
    fsio.sha256_file(big, chunk=4 << 10)
    assert heart.progress > started + 0.5 and heart.phase == "checkpoint"  # beaten while hashing
    # a hang timeout shorter than the hash: no rank is hung at its end
    assert find_hung({0: heart.record()}, 1, _time.time(), hang_timeout_s=0.5, interval_s=0.1) is None
    # a background writer's hashing beats nothing
    before = heart.progress
    t = threading.Thread(target=fsio.sha256_file, args=(big,), kwargs={"chunk": 4 << 10})
    t.start()
    t.join()
    assert heart.progress == before
    fsio.on_progress(None)
    # with several ranks: rank 0 verifies alone while the others wait in the broadcast of its choice -- waiting for a
    # rank that makes checkpoint progress is no hang; once it stalls too, it is
    from trainguard.liveness.watchdog import Heartbeat as HB

    others = [HB(r) for r in (1, 2, 3)]
    for h in others:
        h.beat("checkpoint", 7)
        h.progress -= 10
    fsio.on_progress(lambda: heart.beat(heart.phase))
    fsio.progressed()  # (rank 0 hashing now)
    now = _time.time()
    world = {0: heart.record(), **{h.rank: h.record() for h in others}}
    assert find_hung(world, 4, now, hang_timeout_s=0.5, interval_s=0.1) is None
    heart.progress -= 10
    world[0] = heart.record()
    assert find_hung(world, 4, now, hang_timeout_s=0.5, interval_s=0.1) is not None


def test_a_storage_error_is_retried_and_then_stops_the_run_never_setting_the_newest_aside(tmp_path, monkeypatch):
    """Issue 35 item 4: an EIO while reading the newest manifest was reported "malformed", the resume loaded the
    checkpoint before it and set the newest aside -- an NFS hiccup silently rolled progress back. A storage error
    is retried; a transient one loads the newest; a persistent one stops the resume (every rank: the error is in
    the broadcast choice) naming the file, nothing moved; a rollback does not go past it either (issue 54: nor is
    any rollback chosen from a listing a storage error cut short)."""
    import errno
    from pathlib import Path

    from trainguard.checkpoint import manifest as mf
    from trainguard.checkpoint import layout as signed
    from trainguard.checkpoint.layout import CheckpointError
    from trainguard.checkpoint.rollback import choose_rollback

    monkeypatch.setattr(mf, "IO_BACKOFF_S", 0.01)
    monkeypatch.setattr(signed, "IO_BACKOFF_S", 0.01)
    real_read = signed.read_regular
    failures = {"left": 0}

    def flaky(path):
        if Path(path).parent.name == "step00000020" and Path(path).name == "manifest.json" and failures["left"] > 0:
            failures["left"] -= 1
            raise OSError(errno.EIO, "Input/output error", str(path))
        return real_read(path)

    monkeypatch.setattr(signed, "read_regular", flaky)
    # transient (two failures, three tries): the newest loads
    failures["left"] = 2
    m = _manager({"dir": str(_two(tmp_path / "transient"))})
    assert m.resume_on_start() == "step00000020"
    # persistent: the run stops, naming the file, and not one file moves
    root = _two(tmp_path / "persistent")
    before = _listing(root)
    failures["left"] = 10 ** 6
    m = _manager({"dir": str(root)})
    with pytest.raises(CheckpointError) as e:
        m.resume_on_start()
    assert "step00000020" in str(e.value) and "I/O error" in str(e.value) and "roll progress back" in str(e.value)
    assert _listing(root) == before
    # a rollback chooses nothing from a listing the storage cut short (its abandonment would set the newest aside)
    for step in (30,):
        make_ckpt(root, f"step{step:08d}", step, {"weights.bin": b"n" * step})
    with pytest.raises(signed.StorageError, match="step00000020/manifest.json: I/O error .EIO"):
        choose_rollback(root, 40, "latest_valid")
    # and an error that is a property of the checkpoint (a path through a file, a permission) passes it over
    monkeypatch.setattr(signed, "read_regular", lambda p: (_ for _ in ()).throw(
        NotADirectoryError(errno.ENOTDIR, "Not a directory", str(p))))
    res = mf.verify(root / "step00000030")
    assert not res.ok and not res.io_error
