"""The in-memory tier's framework-free part: who keeps whose copy, which snapshot every rank can load,
and copies that verify as their originals (trainguard/checkpoint/snapshots.py)."""
import pytest
import torch

from trainguard.checkpoint.fsio import save_hashed
from trainguard.checkpoint.layout import CheckpointLayout
from trainguard.checkpoint.manifest import Manifest, verify
from trainguard.checkpoint.manager import CheckpointManager
from trainguard.checkpoint.runid import run_id
from trainguard.checkpoint.snapshots import Placement, SnapshotStore, common_choice, disk_tag, memory_tag
from trainguard.config import parse_block


def test_peers_are_on_the_next_node_and_one_node_has_none():
    place = Placement.build(0, ["a", "a", "b", "b", "c", "c"])
    assert place.node_of == (0, 0, 1, 1, 2, 2)
    assert [place.peer(r) for r in range(6)] == [2, 3, 4, 5, 0, 1]
    assert place.sources() == [4] and Placement(3, place.node_of).sources() == [1]
    assert Placement.build(1, ["a", "a"]).peer(1) is None
    assert [Placement.build(0, ["h"] * 4, ranks_per_node=1).peer(r) for r in range(4)] == [1, 2, 3, 0]


def test_the_choice_is_the_newest_snapshot_every_rank_can_load():
    place = Placement.build(0, ["a", "b"])  # rank 0 keeps rank 1's copies, and rank 1 rank 0's
    table = [{"own": [("s4", 4), ("s6", 6)], "held": {1: [("s4", 4), ("s6", 6)]}},
             {"own": [("s4", 4)], "held": {0: [("s4", 4)]}}]
    assert common_choice(table, place) == ("s6", 6, [(1, 0)])       # rank 1 lost s6: its peer's copy
    assert common_choice(table, place, hi=6) == ("s4", 4, [])       # a rollback before step 6
    assert common_choice(table, place, only={"s4"}) == ("s4", 4, [])  # a "stable" rollback: s6 not stable yet
    assert common_choice(table, place, only=set()) is None
    table[0]["held"] = {1: []}
    assert common_choice(table, place) == ("s4", 4, [])             # no copy of s6 anywhere for rank 1
    assert common_choice(table, place, lo=5) is None
    assert memory_tag("s4") == "memory:s4" and disk_tag("memory:s4") == ("s4", True) and disk_tag("s4") == ("s4", False)


def _shard(store, tag, step, world=2):
    staging = CheckpointLayout(store.own).staging_root(f"{tag}.x")
    staged = staging / tag
    staged.mkdir(parents=True)
    files = {"w.pt": save_hashed({"w": torch.full((3,), float(step))}, staged / "w.pt")}
    store.commit(store.own, staging, f"{tag}.x", Manifest(tag=tag, step=step, files=files, layout={"world": world}))


def test_a_copy_verifies_as_its_original_and_old_ones_go(tmp_path):
    place = Placement.build(0, ["a", "b"])
    mine = SnapshotStore(tmp_path / "run", place, keep=2)
    theirs = SnapshotStore(tmp_path / "run", Placement(1, place.node_of), keep=2)
    for step in (2, 4, 6):
        _shard(mine, f"step{step}", step)
        theirs.unpack(mine.pack(f"step{step}"), theirs.held(0))
    assert CheckpointLayout(mine.own).tags() == ["step4", "step6"]          # keep=2
    assert CheckpointLayout(theirs.held(0)).tags() == ["step4", "step6"]
    assert verify(theirs.held(0) / "step6").ok
    assert theirs.survey(world=2)["held"] == {0: [("step4", 4), ("step6", 6)]}
    assert mine.survey(world=4)["own"] == []                                # another layout's shards do not fit
    (theirs.held(0) / "step6" / "w.pt").write_bytes(b"rot")
    survey = theirs.survey(world=2)
    assert survey["held"] == {0: [("step4", 4)]}                           # a copy that rotted is no copy ...
    (refused,) = survey["refused"]                                         # ... and is named, with why
    assert refused["tag"] == "step6" and refused["bad_file"] == "w.pt" and "size" in refused["reason"]
    assert mine.drop_after(4) == ["step6"] and CheckpointLayout(mine.own).tags() == ["step4"]
    assert mine.bytes_used() > 0
    mine.clear()
    assert not mine.own.exists()


def test_the_run_id_lives_in_the_checkpoint_directory(tmp_path):
    first = run_id(tmp_path / "ck")
    assert run_id(tmp_path / "ck") == first and run_id(tmp_path / "other") != first


def test_a_snapshot_becomes_stable_after_clean_steps_and_a_rollback_forgets_the_later_ones(tmp_path):
    """What lets a "stable" rollback take a snapshot: the marks a disk checkpoint gets, kept in this process."""
    m = CheckpointManager(parse_block({"checkpoint": {"dir": str(tmp_path), "stable_after": 3, "verify_steps": 2}}), None, None, None,
                          None, None)
    m.health.saved(memory_tag("step00000010"), 10)
    for step in (11, 12, 13):
        m.on_step_end(step, 1.0, anomaly=False)
    m.health.saved(memory_tag("step00000020"), 20)
    m.on_step_end(21, 1.0, anomaly=False)
    m.on_step_end(22, 9.0, anomaly=True)                  # an anomaly 2 steps after it: never stable
    m.health.saved(memory_tag("step00000030"), 30)
    for step in (31, 32, 33):
        m.on_step_end(step, 1.0, anomaly=False)
    assert m.stable_snapshots == {"memory:step00000010", "memory:step00000030"}
    assert not (tmp_path / "step00000010").exists()        # nothing written for a snapshot's marks
    m.abandon_after(tmp_path, 25)
    assert m.stable_snapshots == {"memory:step00000010"}


def test_a_cost_budget_spaces_the_snapshots_by_what_they_cost_the_steps():
    from trainguard.checkpoint.pacing import SnapshotPacer

    fixed = SnapshotPacer(10)
    assert [s for s in range(1, 41) if fixed.due(s)] == [10, 20, 30, 40]
    assert not SnapshotPacer(0, 0.01).due(10)
    paced = SnapshotPacer(10, max_overhead=0.02, smoothing=1.0)
    assert [s for s in range(1, 25) if paced.due(s)] == [10, 20]                # the first on a multiple
    clock = [0.0]

    def run(times, events=None):  # one tick per step, the step taking `times[i]` seconds; then its event
        for i, t in enumerate(times):
            clock[0] += t
            paced.tick(clock[0])
            {"writer": paced.writer_done, "disk": paced.disk_saved}.get((events or {}).get(i), lambda: None)()

    run([0.025] * 10)
    assert paced.figures() is None and paced.taken(10) == 10                    # none before: every_steps
    assert not paced.due(19) and paced.due(20)
    # the snapshot's blocking and its writer slowed the steps until the writer was done and the one after by
    # 5 ms each (3 steps); the others took 25 ms
    run([0.030, 0.030, 0.030] + [0.025] * 7, events={1: "writer"})
    cost, step = paced.figures()
    assert (cost, step) == pytest.approx((0.015, 0.025))
    # 15 ms where a step takes 25 ms: 2% of the training time needs >= 30 steps between snapshots
    assert paced.taken(20, cost, step) == 30 and paced.next_step == 50
    # the steps after a disk checkpoint (its blocking part, its writer) are not the tier's cost
    run([0.025, 0.025, 0.025, 0.025] + [0.060, 0.030, 0.030, 0.030] + [0.025] * 8, events={0: "writer", 3: "disk"})
    assert paced.figures() == pytest.approx((0.0, 0.025))
    assert paced.taken(50, 0.0, 0.025) == 10                                    # cheap: every_steps
    assert paced.taken(60, 0.100, 0.025) == 200
    paced.stood_in(260)                                                         # a disk checkpoint where one was due
    assert paced.next_step == 460 and paced.figures() is None
    paced.rewind(100)                                                           # a rollback: one interval on
    assert paced.next_step == 300
    busy = SnapshotPacer(2, max_overhead=0.02)                                   # a writer that outlasts the interval:
    busy.tick(0.0)
    busy.taken(2)
    for t in (0.1, 0.2, 0.3):                                                   # no step free of it to compare with,
        busy.tick(t)
    assert busy.figures() == pytest.approx((0.3, 0.1)) and busy.taken(4, *busy.figures()) >= 150  # all its cost
    smooth = SnapshotPacer(10, max_overhead=0.02)
    smooth.taken(10, cost_s=0.010, step_s=0.025)
    assert smooth.taken(30, cost_s=0.030, step_s=0.025) == 40                   # (10 + 30) / 2 ms


def test_the_tier_writes_only_into_folders_this_user_alone_controls(tmp_path):
    """Issue 25 item 5: the tier lived in /dev/shm/trainguard, created with exist_ok and never checked: another
    user of the node who created it first could place a pickled shard the job loads. Folders are now created
    0700 (files 0600) and a crafted one -- another user's, a symlink, writable by others -- is refused by name."""
    import os
    import stat

    from trainguard.checkpoint.private import UnsafeFolder, expand, private_dir

    assert str(expand("/dev/shm/trainguard-{uid}")) == f"/dev/shm/trainguard-{os.geteuid()}"
    shared = tmp_path / "tmpfs-root"  # a shared sticky folder given as it is (/dev/shm itself): one of ours inside
    shared.mkdir()
    shared.chmod(0o1777)
    assert expand(shared) == shared / f"trainguard-{os.geteuid()}"
    made = private_dir(tmp_path / "shm", "run", "node0", "rank0")
    for p in (tmp_path / "shm", tmp_path / "shm" / "run", made):
        assert stat.S_IMODE(os.lstat(p).st_mode) == 0o700
    assert private_dir(tmp_path / "shm", "run", "node0", "rank0") == made  # (present and sound: accepted)

    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 4242, 4242)  # (the tests run as root: a folder "another user" created first)
    with pytest.raises(UnsafeFolder, match="belongs to another user"):
        private_dir(theirs, "run")
    with pytest.raises(UnsafeFolder, match="belongs to another user"):  # one level down is checked as well
        (tmp_path / "mine").mkdir(mode=0o700)
        (tmp_path / "mine" / "run").mkdir(mode=0o700)
        os.chown(tmp_path / "mine" / "run", 4242, 4242)
        private_dir(tmp_path / "mine", "run", "node0")
    (tmp_path / "target").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "target")
    with pytest.raises(UnsafeFolder, match="is a symlink"):
        private_dir(tmp_path / "link")
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(UnsafeFolder, match="writable by other users"):
        private_dir(open_dir)
    above = tmp_path / "above"  # a world-writable folder above, not sticky: others could rename ours away
    above.mkdir()
    above.chmod(0o777)
    with pytest.raises(UnsafeFolder, match="not sticky"):
        private_dir(above / "shm")
    above.chmod(0o1777)
    assert private_dir(above / "shm").is_dir()

    # the shards themselves: 0600, whatever the umask
    store = SnapshotStore(made.parent.parent, Placement.build(0, ["a"]), keep=2)
    _shard(store, "step2", 2)
    files = [p for p in (store.own / "step2").rglob("*") if p.is_file()]
    assert files and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files)


def test_a_peer_copy_is_plain_bytes_verified_before_it_is_committed(tmp_path):
    """Issue 25 item 8: the peer-copy channel unpickled whatever arrived, and checked paths with a string
    prefix. The message is now a plain length-prefixed format; what does not parse, lies outside the shard's
    folder or does not verify (with a key: is not signed with it) raises and leaves nothing behind."""
    import json
    import pickle

    from trainguard.checkpoint.snapshots import MAGIC

    place = Placement.build(0, ["a", "b"])
    mine = SnapshotStore(tmp_path / "run", place, keep=2, key=b"k")
    theirs = SnapshotStore(tmp_path / "run", Placement(1, place.node_of), keep=2, key=b"k")
    _shard(mine, "step2", 2)
    good = mine.pack("step2")
    assert good.startswith(MAGIC) and b"\x80\x04" not in good[:16]
    assert theirs.unpack(good, theirs.held(0)) == "step2" and verify(theirs.held(0) / "step2", key=b"k").ok

    def forged(files, tag="step4"):
        header = json.dumps({"tag": tag, "files": [[rel, len(b)] for rel, b in files]}).encode()
        return b"".join([MAGIC, len(header).to_bytes(8, "big"), header, *[b for _, b in files]])

    evil = pickle.dumps({"tag": "step4", "files": {"w.pt": b"x"}})
    n = len(good)
    n_before = sorted(p.name for p in theirs.held(0).iterdir())
    header_len = int.from_bytes(good[8:16], "big")
    first_size = json.loads(good[16:16 + header_len])["files"][0][1]
    tampered = bytearray(good)
    tampered[16 + header_len + first_size // 2] ^= 0xFF  # one byte of the first file
    for payload, why in ((evil, "magic"), (good[:n - 3], "add up"),
                         (forged([("../../escape.bin", b"x")]), "outside"),
                         (forged([("/etc/escape.bin", b"x")]), "outside"),
                         (forged([("w.pt", b"x")], tag="../x"), "malformed header"),
                         (forged([("w.pt", b"x")]), "does not verify"),
                         (bytes(tampered), "does not verify")):
        with pytest.raises(ValueError, match=why):
            theirs.unpack(payload, theirs.held(0))
    assert sorted(p.name for p in theirs.held(0).iterdir()) == n_before  # nothing staged is left behind
    assert not (tmp_path / "escape.bin").exists()
    unsigned = SnapshotStore(tmp_path / "plain", place, keep=2)  # a shard signed with no key: refused by a keyed run
    _shard(unsigned, "step6", 6)
    with pytest.raises(ValueError, match="does not verify: manifest.hmac"):
        theirs.unpack(unsigned.pack("step6"), theirs.held(0))
