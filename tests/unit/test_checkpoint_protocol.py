"""The core's commit protocol against a writer of the checkpoint folder who has no key (issue 35): what is signed is
what this process wrote, a conversion reads only verified bytes and loads only when bound to its source, and the
folders trainguard writes into are its own. Run over the fake framework's State (tests/unit/test_session.py)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.unit.test_session import BASE, TorchFramework, TorchState
from trainguard.checkpoint.verified_io import verified_reads
from trainguard.checkpoint.conversion import CACHE, bound, converted
from trainguard.checkpoint.layout import CheckpointError, CheckpointLayout
from trainguard.checkpoint.manifest import Manifest, verify
from trainguard.checkpoint.reader import VerifiedReader, manifest_digest
from trainguard.config import parse_block
from trainguard.events import Record
from trainguard.step.session import GuardSession


def _manager(tmp_path, monkeypatch, state=TorchState, **checkpoint):
    monkeypatch.setenv("TG_PROTOCOL_KEY", "a-key-of-the-job-only")
    block = {**BASE, "metrics": {"jsonl": str(tmp_path / "tg.jsonl")},
             "checkpoint": {**BASE["checkpoint"], "dir": str(tmp_path / "ck"), "hmac_key_env": "TG_PROTOCOL_KEY",
                            **checkpoint}}
    cfg = parse_block(block)
    fw = TorchFramework(cfg)
    session = GuardSession(fw, cfg, 0, 1)
    cp = session.checkpoints(state(fw))
    fw.checkpointer = cp
    records = []
    cp.emit = lambda step, record, detail, ranks=(), action=None: records.append((record, detail))
    return fw, cp, records


def _written(cp) -> Path:
    """The async save in flight, its writer done: the staged folder (what the commit is about to take)."""
    pending = cp.saver.pending
    pending.job.join()
    return Path(pending.info["staging_root"]) / pending.info["tag"]


def test_an_async_save_signs_the_bytes_it_wrote_and_refuses_a_staged_file_swapped_before_the_commit(tmp_path,
                                                                                                   monkeypatch):
    """The hashes travel from the writer to the commit in memory (a collective across ranks), never through a file
    in the shared folder; the commit takes the folder only as the ranks wrote it. A file swapped for one of another
    size: not committed; one of the same size: committed under the true hash, so it never verifies -- its bytes are
    never loaded (seen failing before: the async path hashed marker files any writer of the folder could plant)."""
    fw, cp, records = _manager(tmp_path, monkeypatch, **{"async": True})
    root = Path(cp.cfg.dir)
    fw.steps = 3
    tag = cp.save(root)
    (_written(cp) / "state.pt").write_bytes(b"import os; os.system('payload')")  # another size
    cp.wait_pending()
    (failed,) = [d for r, d in records if r is Record.CHECKPOINT_FAILED]
    assert failed["tag"] == tag and "state.pt" in failed["error"] and "not committed" in failed["error"]
    assert CheckpointLayout(root).tags() == [] and not (root / ".staging" / tag).exists()

    fw.steps = 4
    tag = cp.save(root)
    planted = _written(cp) / "state.pt"
    planted.write_bytes(bytes(planted.stat().st_size))  # the same size, other bytes
    cp.wait_pending()
    assert CheckpointLayout(root).tags() == [tag]
    res = verify(root / tag, key=cp.key)
    assert not res.ok and res.bad_file == "state.pt" and "sha256" in res.reason
    fw.steps = 0
    with pytest.raises(CheckpointError, match="state.pt"):  # the resume names it and loads nothing
        cp.resume_on_start()
    assert fw.steps == 0

    fw.steps = 5  # and an untouched save commits, signed, and verifies
    tag = cp.save(root)
    cp.wait_pending()
    assert verify(root / tag, key=cp.key).ok and (root / tag / "manifest.hmac").exists()


def test_a_planted_staging_link_is_moved_aside_and_nothing_is_written_through_it(tmp_path, monkeypatch):
    """A link planted where the staging folder goes (in a folder of the job's user's) is renamed aside there, kept,
    said -- never followed, and never a failed save (a planted name failed every save, issue 54's review)."""
    fw, cp, _ = _manager(tmp_path, monkeypatch)
    root = Path(cp.cfg.dir)
    root.mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, root / ".staging")
    fw.steps = 5
    cp.save(root)
    (aside,) = root.glob(".staging.foreign.*")
    assert aside.is_symlink() and list(elsewhere.iterdir()) == []
    assert CheckpointLayout(root).tags() == ["step00000005"] and not (root / ".staging").is_symlink()


class ConvertingState(TorchState):
    """A framework whose checkpoints load at another layout only through a converted copy (as DeepSpeed's universal
    checkpoint): the converter copies the folder, and records what it read."""

    read: list[bytes] = []
    folders: list[int] = []  # the mode of the folder the converter writes its output into

    def layout(self):
        return {**super().layout(), "dp": self.fw.dp}

    def conversion(self, man):
        return man.layout["dp"] != self.fw.dp

    def convert(self, source, out):
        ConvertingState.read.append((source / "state.pt").read_bytes())
        ConvertingState.folders.append(out.parent.stat().st_mode & 0o777)
        shutil.copytree(source, out)
        return None


def _two_checkpoints(tmp_path, monkeypatch):
    fw, cp, _ = _manager(tmp_path, monkeypatch, state=ConvertingState)
    fw.dp = 2
    root = Path(cp.cfg.dir)
    for step in (10, 20):
        fw.steps = step
        with torch.no_grad():
            fw.model[0].weight.fill_(float(step))
        cp.save(root)
    fw.dp = 1  # resumed at another data-parallel size
    ConvertingState.read = []
    return fw, cp, root


def test_a_conversion_reads_only_verified_bytes(tmp_path, monkeypatch):
    """The converter unpickles what it reads: it runs on a private copy written from the bytes rank 0 checked, never
    on the source folder by path -- a file swapped after the check is refused, never converted."""
    fw, cp, root = _two_checkpoints(tmp_path, monkeypatch)
    tag = "step00000020"
    digest = manifest_digest(root / tag)
    reader = VerifiedReader(root / tag, digest, cp.key)  # (the choice: verified, pinned)
    good = (root / tag / "state.pt").read_bytes()
    (root / tag / "state.pt").write_bytes(good[:-8] + b"payload!")  # swapped after the check
    with pytest.raises(CheckpointError, match="state.pt"):
        converted(cp, root, tag, Manifest.read(root / tag), digest, reader)
    assert ConvertingState.read == []
    mode = (root / CACHE).stat().st_mode & 0o777
    assert mode == 0o700, oct(mode)  # (its folders are the job's own)


def test_a_cached_conversion_loads_only_when_bound_to_its_source(tmp_path, monkeypatch):
    """An older signed conversion copied under the newest checkpoint's digest (the folder an attacker can write, not
    the key) is converted again, never loaded: the cache says which source it is of, and verify() refuses a
    manifest under another tag's name."""
    fw, cp, root = _two_checkpoints(tmp_path, monkeypatch)
    old, new = "step00000010", "step00000020"
    out_old, _ = converted(cp, root, old, Manifest.read(root / old), manifest_digest(root / old),
                           VerifiedReader(root / old, manifest_digest(root / old), cp.key))
    d_new = manifest_digest(root / new)
    assert bound(out_old / old, d_new, new, 20) is not None  # (not the newest's conversion)
    forged = root / CACHE / d_new[:16] / new
    shutil.copytree(out_old / old, forged)  # the old conversion, signed, under the newest's digest and tag
    assert not verify(forged, key=cp.key).ok
    ConvertingState.read = []
    fw.steps = 0
    cp.resume_on_start()
    assert fw.steps == 20 and float(fw.model[0].weight[0, 0]) == 20.0  # the newest's state, converted anew
    assert len(ConvertingState.read) == 1
    # the converter's output is hashed from disk once it exits, in a folder no other user can write: 0700, the job's
    assert ConvertingState.folders[-1] == 0o700
    assert bound(forged, d_new, new, 20) is None and verify(forged, key=cp.key).ok


class DcpState(TorchState):
    """A framework whose writer trainguard does not call itself -- torch.distributed.checkpoint's, as megatron's
    dist_checkpointing (its pickled ``.metadata`` written to a temporary name and renamed) -- hashed as it writes
    (trainguard.checkpoint.write_hashes). ``tamper``: what a writer of the folder does between the write and the
    commit."""

    tamper = None

    def write(self, staged, tag, **kw):
        import torch.distributed.checkpoint as dcp

        from trainguard.checkpoint.write_hashes import hashed_writes

        (staged / "dist").mkdir()
        with hashed_writes(staged) as hashes:
            dcp.save({"model": self.fw.model.state_dict(), "steps": torch.tensor(self.fw.steps)},
                     checkpoint_id=str(staged / "dist"))
        if DcpState.tamper is not None:
            DcpState.tamper(staged / "dist" / ".metadata")
        return hashes.table

    def load(self, root, tag, man, reader, purpose, converted=False, **kw):
        import torch.distributed.checkpoint as dcp

        state = {"model": self.fw.model.state_dict(), "steps": torch.tensor(0)}
        with verified_reads(reader):
            dcp.load(state, checkpoint_id=str(root / tag / "dist"))
        self.fw.model.load_state_dict(state["model"])
        self.fw.steps = int(state["steps"])
        return tag, {}


def test_a_frameworks_own_writer_is_hashed_as_it_writes_and_a_swapped_metadata_is_never_signed(tmp_path, monkeypatch):
    """Issue 35 item 1: megatron's state write returned no hashes and rank 0 hashed dist_checkpointing's files after
    they were written -- a ``.metadata`` (a pickle) replaced during the save was signed, verified and unpickled on
    resume. Now every file is hashed from the bytes as written: a swap of another size stops the commit; one of the
    same size is committed under the true hash and never verifies, so it is never unpickled."""
    fw, cp, _ = _manager(tmp_path, monkeypatch, state=DcpState)
    root = Path(cp.cfg.dir)
    fw.steps = 4
    DcpState.tamper = None
    tag = cp.save(root)  # untouched: committed, signed, every file hashed as written
    assert verify(root / tag, key=cp.key).ok
    man = Manifest.read(root / tag)
    assert {"dist/.metadata", "dist/__0_0.distcp"} <= set(man.files)
    fw.steps = 0
    cp.resume_on_start()
    assert fw.steps == 4  # (and it loads back through the verified reader)

    fw.steps = 8
    DcpState.tamper = lambda p: p.write_bytes(b"cos\nsystem\n(S'payload'\ntR.")  # another size
    with pytest.raises(CheckpointError, match=r"\.metadata"):
        cp.save(root)
    assert CheckpointLayout(root).tags() == [tag]

    fw.steps = 12
    DcpState.tamper = lambda p: p.write_bytes(bytes(p.stat().st_size))  # the same size, other bytes
    bad = cp.save(root)
    res = verify(root / bad, key=cp.key)
    assert not res.ok and res.bad_file == "dist/.metadata" and "sha256" in res.reason
    DcpState.tamper = None


def test_a_run_id_that_is_not_a_plain_name_is_refused_never_followed(tmp_path):
    """Issue 35 item 7: the run id read from the marker names the in-memory tier's folder; an absolute path or '..'
    written there moved the tier outside its checked folder. Now it is refused by name."""
    import json

    from trainguard.checkpoint.runid import RUN_ID, run_id

    first = run_id(tmp_path)
    assert run_id(tmp_path) == first
    for bad in ("../../elsewhere", "/dev/shm/theirs", "", 7):
        (tmp_path / RUN_ID).write_text(json.dumps({"id": bad}))
        with pytest.raises(CheckpointError, match=RUN_ID):
            run_id(tmp_path)


def test_a_signing_key_must_be_long_enough_and_checking_takes_any(tmp_path, monkeypatch, capsys):
    """Issue 35 item 7: no minimum key length. A run (or `ckpt sign`) with a key under 16 bytes is refused naming
    the variable; `ckpt verify` still checks an old short key's signatures (to move a run to a new key)."""
    from trainguard.checkpoint.auth import key_from
    from trainguard.cli import main
    from trainguard.errors import ConfigError

    monkeypatch.setenv("TG_SHORT", "s3cret")
    cfg = parse_block({"checkpoint": {"dir": str(tmp_path / "ck"), "hmac_key_env": "TG_SHORT"}}).checkpoint
    with pytest.raises(ConfigError, match="TG_SHORT.*6 bytes"):
        key_from(cfg)
    (tmp_path / "ck").mkdir()
    assert main(["ckpt", "sign", str(tmp_path / "ck"), "--key-env", "TG_SHORT"]) == 2
    assert "at least 16" in capsys.readouterr().err
    assert main(["ckpt", "verify", str(tmp_path / "ck"), "--key-env", "TG_SHORT"]) in (0, 1)  # (checked, not refused)


def test_a_load_through_a_file_object_reads_only_verified_bytes(tmp_path):
    """Issue 35 item 7: ``verified_reads`` checked path arguments only; ``torch.load(open(p, "rb"))`` of a swapped
    file ran its payload. A file object opened on a file of the checkpoint is read through the verified reader too."""
    from trainguard.checkpoint.manifest import hash_files, list_files

    d = tmp_path / "step00000001"
    d.mkdir()
    torch.save({"w": torch.ones(2)}, d / "state.pt")
    Manifest(tag=d.name, step=1, files=hash_files(d, list_files(d))).write(d)
    reader = VerifiedReader(d)
    with verified_reads(reader), open(d / "state.pt", "rb") as f:
        assert torch.equal(torch.load(f, weights_only=True)["w"], torch.ones(2))
    torch.save({"w": torch.zeros(2)}, d / "state.pt")  # swapped after the check
    with pytest.raises(CheckpointError, match="state.pt"), verified_reads(VerifiedReader(d)), open(d / "state.pt", "rb") as f:
        torch.load(f, weights_only=True)


def test_a_load_right_after_an_async_save_loads_that_save(tmp_path, monkeypatch):
    """save_checkpoint then load_checkpoint with no step between (evaluating the final save): the background save is
    committed first -- the load does not take the previous checkpoint, or find none."""
    fw, cp, _ = _manager(tmp_path, monkeypatch, **{"async": True})
    root = Path(cp.cfg.dir)
    fw.steps = 7
    tag = cp.save(root)
    fw.steps = 0
    assert cp.load(root) == tag and fw.steps == 7


def test_a_planted_abandoned_link_is_moved_aside_and_nothing_moves_through_it(tmp_path, monkeypatch):
    """A rollback sets the abandoned trajectory's checkpoints aside in .abandoned/: never through a link planted
    there (they would move into a folder someone else owns)."""
    fw, cp, _ = _manager(tmp_path, monkeypatch)
    root = Path(cp.cfg.dir)
    for step in (5, 10):
        fw.steps = step
        cp.save(root)
    elsewhere = tmp_path / "theirs"
    elsewhere.mkdir()
    os.symlink(elsewhere, root / ".abandoned")
    assert cp.abandon_after(root, 5) == ["step00000010"]  # (the link moved aside, kept: never followed)
    assert list(elsewhere.iterdir()) == [] and CheckpointLayout(root).tags() == ["step00000005"]
    assert (root / ".abandoned").is_dir() and not (root / ".abandoned").is_symlink()


def test_a_tag_folder_kept_aside_is_renamed_where_it_is_when_it_cannot_change_parents(tmp_path, monkeypatch):
    """Another user's folder cannot move into .abandoned (a rename across folders rewrites its ``..``, which needs
    its owner's write): it is renamed in place, kept -- the commit and the rollback both raised there before."""
    import os

    from trainguard.checkpoint import private

    tag = tmp_path / "step00000050"
    tag.mkdir()
    (tag / "model.pt").write_bytes(b"w")
    assert private.keep_aside(tag, tmp_path / ".abandoned", "step00000050.a1") == tmp_path / ".abandoned" / "step00000050.a1"
    other = tmp_path / "step00000100"
    other.mkdir()
    real = os.replace

    def across_refused(src, dst):
        if Path(src).parent != Path(dst).parent:
            raise PermissionError(13, "Permission denied", str(src))
        return real(src, dst)

    monkeypatch.setattr(private.os, "replace", across_refused)
    dest = private.keep_aside(other, tmp_path / ".abandoned", "step00000100.b2")
    assert dest == tmp_path / ".step00000100.b2.foreign" and dest.is_dir() and not other.exists()


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_commit_leaves_no_empty_staging_folder_and_never_removes_another_saves(tmp_path, monkeypatch, asynchronous):
    """HF's checkpoint-N is a save root of its own: every one held an empty ``.staging`` after its commit (issue 53).
    A commit removes it once empty -- and leaves one holding another save still under way (its staging root kept)."""
    fw, cp, records = _manager(tmp_path, monkeypatch, **{"async": asynchronous})
    hf = tmp_path / "hf" / "checkpoint-4"
    fw.steps = 4
    cp.save(hf)
    cp.wait_pending()
    assert (hf / "step00000004").is_dir() and not (hf / ".staging").exists(), sorted(p.name for p in hf.iterdir())
    other = hf / ".staging" / "step00000005.underway"  # (another save's staging, in flight)
    other.mkdir(parents=True)
    fw.steps = 6
    cp.save(hf)
    cp.wait_pending()
    assert (hf / "step00000006").is_dir() and other.is_dir()
    assert not [r for r, _ in records if r is Record.CHECKPOINT_FAILED]


def test_a_save_the_framework_cannot_write_leaves_no_staging_behind(tmp_path, monkeypatch):
    """A framework that cannot write its state yet (megatron's distributed optimizer before its first update: an
    insured save, a record) left its staging folder, and so .staging, behind every time."""
    class Unwritable(TorchState):
        def write(self, staged, tag, **kw):
            raise AssertionError("no state to write yet")

    fw, cp, records = _manager(tmp_path, monkeypatch, state=Unwritable)
    root = Path(cp.cfg.dir)
    fw.steps = 2
    with pytest.raises(AssertionError, match="no state to write yet"):
        cp.save(root)
    assert not (root / ".staging").exists() and CheckpointLayout(root).tags() == []


def test_a_load_the_framework_names_is_said_as_its_own_not_as_trainguards_choice(tmp_path, monkeypatch):
    """Accelerate's load_state (and your load_checkpoint(dir, tag)) names the checkpoint: the resume record said
    'checkpoint.resume: "latest_valid" -- trainguard loads the newest...' with advice to turn it off, as if trainguard
    had overridden the load (a new user's Accelerate trial). A named load says it was asked for; a load that names no
    tag is trainguard's choice by its rule, said as before."""
    fw, cp, records = _manager(tmp_path, monkeypatch)
    root = Path(cp.cfg.dir)
    fw.steps = 7
    tag = cp.save(root)
    fw.steps = 0
    assert cp.load(root, tag=tag) == tag and fw.steps == 7
    (asked,) = [d for r, d in records if r is Record.RESUME]
    assert f"asked for checkpoint {tag}" in asked["why"] and "start fresh" not in asked["advice"], asked
    records.clear()
    fw.steps = 0
    cp.load(root)
    (chosen,) = [d for r, d in records if r is Record.RESUME]
    assert 'checkpoint.resume: "latest_valid"' in chosen["why"] and chosen["advice"].startswith("to start fresh")
