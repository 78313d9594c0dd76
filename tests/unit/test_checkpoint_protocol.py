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
from trainguard.checkpoint.conversion import CACHE, bound, converted
from trainguard.checkpoint.layout import CheckpointError, CheckpointLayout
from trainguard.checkpoint.manager import CheckpointManager
from trainguard.checkpoint.manifest import Manifest, VerifiedReader, manifest_digest, verify
from trainguard.config import parse_block
from trainguard.events import Record
from trainguard.session import GuardSession


def _manager(tmp_path, monkeypatch, state=TorchState, **checkpoint):
    monkeypatch.setenv("TG_PROTOCOL_KEY", "a-key-of-the-job-only")
    block = {**BASE, "metrics": {"jsonl": str(tmp_path / "tg.jsonl")},
             "checkpoint": {**BASE["checkpoint"], "dir": str(tmp_path / "ck"), "hmac_key_env": "TG_PROTOCOL_KEY",
                            **checkpoint}}
    cfg = parse_block(block)
    fw = TorchFramework(cfg)
    session = GuardSession(fw, cfg, 0, 1)
    cp = CheckpointManager(cfg, session.guard, session.heart, state(fw))
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


def test_a_planted_staging_link_is_refused_and_nothing_is_written_through_it(tmp_path, monkeypatch):
    fw, cp, _ = _manager(tmp_path, monkeypatch)
    root = Path(cp.cfg.dir)
    root.mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, root / ".staging")
    with pytest.raises(CheckpointError, match="symlink"):
        cp.save(root)
    assert list(elsewhere.iterdir()) == [] and CheckpointLayout(root).tags() == []


class ConvertingState(TorchState):
    """A framework whose checkpoints load at another layout only through a converted copy (as DeepSpeed's universal
    checkpoint): the converter copies the folder, and records what it read."""

    read: list[bytes] = []

    def layout(self):
        return {**super().layout(), "dp": self.fw.dp}

    def conversion(self, man):
        return man.layout["dp"] != self.fw.dp

    def convert(self, source, out):
        ConvertingState.read.append((source / "state.pt").read_bytes())
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
    assert bound(forged, d_new, new, 20) is None and verify(forged, key=cp.key).ok
