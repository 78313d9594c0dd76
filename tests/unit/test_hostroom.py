"""An asynchronous save's host copies against the node's memory (trainguard.checkpoint.hostroom): a save whose copies
would not fit is written synchronously, said once, and loads as any other -- never an OOM kill of a run the framework's
own synchronous save keeps alive."""
from __future__ import annotations

import logging
from pathlib import Path

from tests.unit.test_checkpoint_protocol import _manager
from tests.unit.test_session import TorchState
from trainguard.checkpoint import hostroom
from trainguard.checkpoint.layout import CheckpointLayout

GiB = 2**30


def test_copies_that_would_take_most_of_the_nodes_memory_are_refused_with_the_figures():
    assert hostroom.refusal(1 * GiB, 8, have=100 * GiB) is None
    why = hostroom.refusal(12 * GiB, 8, have=100 * GiB)  # (96 GiB of 100: more than the margin leaves)
    assert "12.0 GiB on each of 8 rank(s)" in why and "96.0 GiB in all" in why and "100.0 GiB" in why
    assert hostroom.refusal(None, 8, have=1) is None and hostroom.refusal(0, 8, have=1) is None  # (nothing copied)


def test_what_the_node_has_is_read_from_meminfo_and_the_jobs_cgroup(tmp_path):
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       32000000 kB\nMemFree:  100 kB\nMemAvailable:   2048 kB\n")
    assert hostroom._meminfo(info) == 2048 * 1024
    assert hostroom._meminfo(tmp_path / "none") is None
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text("1000000\n")
    (v2 / "memory.current").write_text("400000\n")
    assert hostroom._cgroup_room(v2) == 600000
    (v2 / "memory.max").write_text("max\n")  # (no limit)
    assert hostroom._cgroup_room(v2) is None
    v1 = tmp_path / "v1" / "memory"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("5000\n")
    (v1 / "memory.usage_in_bytes").write_text("6000\n")  # (over: nothing left)
    assert hostroom._cgroup_room(tmp_path / "v1") == 0
    assert hostroom.available() is not None  # (this machine says, one way or the other)


def test_local_ranks_from_torchrun_or_slurm(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4(x2)")
    assert hostroom.local_ranks() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert hostroom.local_ranks() == 8


def _sized(nbytes):
    class Sized(TorchState):
        def host_bytes(self, local=False):
            return nbytes
    return Sized


def test_an_async_save_too_large_for_the_nodes_memory_is_written_synchronously_and_said_once(tmp_path, monkeypatch,
                                                                                             caplog):
    """This machine's own memory, a state that says it is a PiB a rank: every save committed before ``save`` returns
    (no background write), one warning for the run, and it loads."""
    fw, cp, _ = _manager(tmp_path, monkeypatch, state=_sized(2**50), **{"async": True})
    root = Path(cp.cfg.dir)
    with caplog.at_level(logging.WARNING, logger="trainguard"):
        for step in (3, 6):
            fw.steps = step
            tag = cp.save(root)
            assert cp.saver.pending.job is None and CheckpointLayout(root).tags()[-1] == tag
    said = [r.getMessage() for r in caplog.records if "synchronously" in r.getMessage()]
    assert len(said) == 1 and "1048576.0 GiB on each of" in said[0], said
    fw.steps = 0
    assert cp.load(root) == tag and fw.steps == 6


def test_an_async_save_that_fits_stays_in_the_background(tmp_path, monkeypatch, caplog):
    fw, cp, _ = _manager(tmp_path, monkeypatch, state=_sized(2**20), **{"async": True})
    fw.steps = 3
    with caplog.at_level(logging.WARNING, logger="trainguard"):
        tag = cp.save(Path(cp.cfg.dir))
    assert cp.saver.pending.job is not None and cp.saver.pending.tag() == tag
    cp.wait_pending()
    assert CheckpointLayout(Path(cp.cfg.dir)).tags() == [tag]
    assert not [r for r in caplog.records if "synchronously" in r.getMessage()]
