"""Issue 54: with a key, every decision about a checkpoint comes from bytes whose signature verified -- the probes of a
writer of the checkpoint folder who holds no key, each planted and run over the fake framework
(tests/unit/test_session.py), each asserting that nothing the writer wanted happened. Each fails without its fix: the
listing read the manifest's ``step`` unverified, the marks were unsigned files, the loader read the manifest again
after verifying it, a storage error read as a verdict."""
from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from tests.unit.test_checkpoint_protocol import _manager
from trainguard.checkpoint import layout as listing
from trainguard.checkpoint import signed
from trainguard.checkpoint.layout import STABLE, TRAJECTORY, CheckpointError, CheckpointLayout
from trainguard.checkpoint.retention import apply as retention
from trainguard.checkpoint.rollback import abandon_after, choose_rollback, fitting_after

KEY = b"a-key-of-the-job-only"


def _saved(tmp_path, monkeypatch, steps=(5, 10, 15), **checkpoint):
    fw, cp, records = _manager(tmp_path, monkeypatch, **checkpoint)
    root = Path(cp.cfg.dir)
    for step in steps:
        fw.steps = step
        cp.save(root)
    assert cp.key == KEY
    return fw, cp, root, records


def _edit(tag_dir: Path, **changes) -> None:
    """What a writer without the key can do to a committed checkpoint's manifest."""
    man = json.loads((tag_dir / "manifest.json").read_text())
    man.update(changes)
    (tag_dir / "manifest.json").write_text(json.dumps(man))


def test_an_edited_step_in_old_manifests_never_makes_retention_delete_the_new_checkpoints(tmp_path, monkeypatch,
                                                                                          caplog):
    """Probe 1 (HIGH): ``step: 1000000000`` in the oldest manifests sorted them newest, and retention deleted every
    new checkpoint right after its commit. Now unsigned manifests are passed over: they decide nothing."""
    fw, cp, root, _ = _saved(tmp_path, monkeypatch, keep_last=2)
    assert CheckpointLayout(root, KEY).tags() == ["step00000010", "step00000015"]
    _edit(root / "step00000010", step=1_000_000_000)
    _edit(root / "step00000015", step=1_000_000_001)
    fw.steps = 20
    cp.save(root)
    assert (root / "step00000020").is_dir(), "the new checkpoint was deleted on what an unsigned manifest says"
    layout = CheckpointLayout(root, KEY)
    assert layout.tags() == ["step00000020"]
    assert {p["tag"] for p in layout.passed_over()} == {"step00000010", "step00000015"}
    assert all("HMAC mismatch" in p["reason"] for p in layout.passed_over())
    assert "step00000010: HMAC mismatch" in caplog.text  # (named in the log by retention)
    fw.steps = 0
    assert cp.load(root) == "step00000020" and fw.steps == 20


def test_an_edited_precision_never_moves_the_rollback_floor_past_every_checkpoint(tmp_path, monkeypatch):
    """Probe 1 (HIGH): one old manifest edited to ``precision: fp16`` set ``not_before`` past every checkpoint: no
    rollback target, training went on with damaged weights."""
    fw, cp, root, _ = _saved(tmp_path, monkeypatch)
    assert fitting_after(root, "precision", "fp32", KEY) == 0
    _edit(root / "step00000015", layout={"precision": "fp16"})
    assert fitting_after(root, "precision", "fp32", KEY) == 0, "an unsigned manifest moved the floor"
    tag, _, bad = choose_rollback(root, 16, "latest_valid", fitting_after(root, "precision", "fp32", KEY), key=KEY)
    assert tag == "step00000010" and bad[0]["tag"] == "step00000015" and "HMAC" in bad[0]["reason"]


def test_a_planted_stable_mark_neither_deletes_the_real_one_nor_is_resumed_from(tmp_path, monkeypatch):
    """Probe 2 (MED): a planted ``stable.json`` on a damaged checkpoint made retention delete the real stable one and
    ``resume: "stable"`` load the damaged weights. Marks are signed and bound to their checkpoint's manifest: a
    planted one, or a real one copied from another checkpoint, reads as absent."""
    fw, cp, root, _ = _saved(tmp_path, monkeypatch)
    assert signed.write_mark(root / "step00000005", STABLE, {"stable_at_step": 7, "stable_after": 2}, KEY) is None
    (root / "step00000015" / STABLE).write_text(json.dumps({"stable_at_step": 17, "stable_after": 2}))  # planted
    (root / "step00000010" / STABLE).write_bytes((root / "step00000005" / STABLE).read_bytes())  # a real one, copied
    layout = CheckpointLayout(root, KEY)
    layout.steps()
    assert [t for t in layout.tags() if signed.stable(layout, t)] == ["step00000005"]
    assert retention(root, 1, 1, KEY) == ["step00000010"]  # the newest one and the newest stable one kept
    assert CheckpointLayout(root, KEY).tags() == ["step00000005", "step00000015"]
    fw2, cp2, _ = _manager(tmp_path, monkeypatch, resume="stable")
    assert cp2.resume_on_start() == "step00000005" and fw2.steps == 5
    # without a key nothing is authenticated: a plain mark is taken as written (as before)
    assert signed.stable(CheckpointLayout(root), "step00000005") is True


def test_a_malformed_or_unsigned_trajectory_is_ignored_never_a_crash_of_the_restart(tmp_path, monkeypatch):
    """Probe 2 (MED): a malformed ``trajectory.json`` crashed every restart. Now the resume's self-test is armed only
    from a signed trajectory bound to the manifest loaded; anything else is said in the log and ignored."""
    fw, cp, root, _ = _saved(tmp_path, monkeypatch, verify_steps=2)
    (root / "step00000015" / TRAJECTORY).write_text('{"losses": [1, 2')
    fw2, cp2, _ = _manager(tmp_path, monkeypatch, verify_steps=2)
    assert cp2.resume_on_start() == "step00000015" and cp2.resume_check is None
    (root / "step00000015" / TRAJECTORY).write_text(json.dumps({"losses": {"16": "x"}}))
    fw3, cp3, _ = _manager(tmp_path, monkeypatch, verify_steps=2)
    assert cp3.resume_on_start() == "step00000015" and cp3.resume_check is None
    assert signed.write_mark(root / "step00000015", TRAJECTORY, {"losses": {"16": 0.5, "17": 0.4}}, KEY) is None
    fw4, cp4, _ = _manager(tmp_path, monkeypatch, verify_steps=2)
    assert cp4.resume_on_start() == "step00000015" and cp4.resume_check.expected == {16: 0.5, 17: 0.4}


def test_what_is_loaded_is_the_manifest_verified_never_one_read_again(tmp_path, monkeypatch):
    """Probe 3 (MED): the loader read the manifest again after verifying it; what was swapped in that window set the
    step, the reshard decision and the abandon. Now every rank pins the digest of the bytes rank 0 verified and uses
    the manifest parsed from the bytes it checked."""
    from trainguard.checkpoint import manifest as mf
    from trainguard.checkpoint import resume

    fw, cp, root, _ = _saved(tmp_path, monkeypatch)
    real_verify = resume.verify
    swapped = {}

    def verify_then_swap(tag_dir, **kw):
        res = real_verify(tag_dir, **kw)
        if res.ok and not swapped:  # right after rank 0 verified: another (unsigned) manifest swapped in
            swapped["tag"] = Path(tag_dir).name
            _edit(Path(tag_dir), step=999)
        return res

    monkeypatch.setattr(resume, "verify", verify_then_swap)
    fw2, cp2, _ = _manager(tmp_path, monkeypatch)
    with pytest.raises(CheckpointError, match="changed since it was verified"):
        cp2.resume_on_start()
    assert swapped["tag"] == "step00000015" and fw2.steps == 0
    assert CheckpointLayout(root).tags()[-1] == "step00000015" and not (root / ".abandoned").exists()
    assert mf.verify(root / "step00000010", key=KEY).digest == listing.read_manifest(root / "step00000010", KEY).digest


def test_a_storage_error_is_an_io_error_never_a_verdict(tmp_path, monkeypatch):
    """Probe 8: an EIO on ``manifest.hmac`` read as "unauthenticated", and one while listing sorted the newest as step
    -1 (the older one loaded, the newest set aside). Now it stops the resume naming the file and errno; nothing is
    moved, deleted or judged."""
    fw, cp, root, _ = _saved(tmp_path, monkeypatch)
    monkeypatch.setattr(listing, "IO_BACKOFF_S", 0.001)
    real = listing.read_regular

    def eio(path):
        if Path(path).parent.name == "step00000015" and Path(path).name in ("manifest.hmac", "manifest.json"):
            raise OSError(errno.EIO, "Input/output error", str(path))
        return real(path)

    monkeypatch.setattr(listing, "read_regular", eio)
    before = sorted(p.name for p in root.iterdir() if not p.name.startswith("."))
    fw2, cp2, _ = _manager(tmp_path, monkeypatch)
    with pytest.raises(CheckpointError) as e:
        cp2.resume_on_start()
    assert "step00000015" in str(e.value) and "EIO" in str(e.value) and fw2.steps == 0
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == before
    with pytest.raises(listing.StorageError):  # retention deletes nothing on it (its caller logs and goes on)
        retention(root, 1, 0, KEY)
    with pytest.raises(listing.StorageError):  # nor is anything set aside on it
        abandon_after(root, 5, KEY)
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == before


def test_files_in_shared_folders_are_never_written_through_a_planted_link(tmp_path, monkeypatch):
    """Probe 4 (MED): ``atomic_write_text``'s predictable ``.<name>.tmp.<pid>`` was opened and chmodded through a
    planted link (a 0600 file of the victim overwritten and made 0644), and the logs were appended through one. Now
    the temporary is exclusive under a random name, and appends refuse a link, a FIFO or a device."""
    import os

    from trainguard.checkpoint.fsio import atomic_write_text
    from trainguard.metrics.jsonl import JsonlSink
    from trainguard.metrics.sharedfs import open_append

    victim = tmp_path / "victim"
    victim.write_text("secret")
    victim.chmod(0o600)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.symlink(victim, shared / f".stable.json.tmp.{os.getpid()}")  # the old name, planted
    atomic_write_text(shared / "stable.json", "{}")
    assert victim.read_text() == "secret" and victim.stat().st_mode & 0o777 == 0o600
    assert (shared / "stable.json").read_text() == "{}" and not (shared / "stable.json").is_symlink()
    os.symlink(victim, shared / "tg.jsonl")
    sink = JsonlSink(shared / "tg.jsonl")  # (not through the link: a fresh file of its own beside it, said)
    sink.metric(1, loss=1.0)
    sink.close()
    assert sink.path != shared / "tg.jsonl" and sink.path.parent == shared
    os.mkfifo(shared / "marker")
    with pytest.raises(OSError):
        open_append(shared / "marker")
    assert victim.read_text() == "secret"


def test_the_universal_conversion_never_imports_from_the_jobs_working_directory(tmp_path, monkeypatch):
    """Probe 7 (MED): ``python -m deepspeed.checkpoint.ds_to_universal`` ran a planted
    ``deepspeed/checkpoint/ds_to_universal.py`` from the job's working directory. Now it runs from the private
    folder of the verified copy."""
    from tests.support.require import imported

    imported("deepspeed", "extras")
    from ds_plugins.checkpoint import DeepSpeedState

    planted = tmp_path / "cwd" / "deepspeed" / "checkpoint"
    planted.mkdir(parents=True)
    for d in (planted.parent, planted):
        (d / "__init__.py").write_text("")
    (planted / "ds_to_universal.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').write('payload')\n")
    source = tmp_path / "private" / ".source" / "step00000005"
    source.mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "cwd")
    DeepSpeedState.convert(None, source, tmp_path / "private" / "step00000005")
    assert not (tmp_path / "ran").exists(), "the converter imported a module planted in the working directory"


def test_a_peer_that_announces_more_than_node_memory_holds_is_refused_never_allocated(tmp_path, monkeypatch):
    """Probe 9 (LOW): ``_recv`` allocated whatever size a peer announced. Now a size larger than the node memory
    left where the copy would go is refused, naming the rank, before any allocation."""
    import torch

    from trainguard.checkpoint import memory_tier as mt

    monkeypatch.setattr(mt.dist, "recv", lambda t, src, group=None: t.fill_(1 << 60))
    real_empty = torch.empty
    monkeypatch.setattr(mt.torch, "empty", lambda *a, **k: pytest.fail("allocated") if a and a[0] > 1 << 40
                        else real_empty(*a, **k))
    with pytest.raises(RuntimeError, match="rank 3 announced a shard of 1152921504606846976 bytes"):
        mt._recv(3, None, tmp_path)


def _squatted(tmp_path) -> Path:
    """The per-user snapshot folder's name taken first by another user (root: a folder chowned to another uid; else a
    link to a folder elsewhere)."""
    import os

    taken = tmp_path / f"trainguard-{os.geteuid()}"
    if os.geteuid() == 0:
        taken.mkdir()
        os.chown(taken, 12345, 12345)
    else:
        (tmp_path / "theirs").mkdir()
        taken.symlink_to(tmp_path / "theirs")
    return taken


def test_the_snapshot_folders_name_taken_by_another_user_is_no_stop(tmp_path, caplog):
    """Probe 9 (LOW): another local user who created ``/dev/shm/trainguard-<uid>`` first stopped every job with
    snapshots at start. Now the tier takes a fresh folder of its own beside it (0700, a random name), said in the log;
    a name the user chose (no ``{uid}``) is still checked and refused as before."""
    import os

    from trainguard.checkpoint.private import UnsafeFolder, expand, private_dir

    taken = _squatted(tmp_path)
    base = expand(tmp_path / "trainguard-{uid}")
    assert base != taken and base.parent == tmp_path and base.name.startswith(taken.name + "-")
    assert private_dir(base, "run", "node", "rank0").is_dir() and (base.stat().st_mode & 0o777) == 0o700
    assert "another user took the name first" in caplog.text
    with pytest.raises(UnsafeFolder):
        private_dir(expand(taken), "run")


def test_a_fresh_start_sets_aside_every_checkpoint_and_a_rotation_keeps_the_marks_it_verified(tmp_path, monkeypatch,
                                                                                                capsys):
    """From a review of this work: ``resume: "none"`` with a key set aside only the verified checkpoints (one signed
    with an old key stayed, and a later save of its tag deleted it); a key rotation dropped every stable mark (then
    retention deleted what they protected); a rotation signed a checkpoint carrying no signature at all; a storage
    error on a stable mark escaped rank 0's choice (the other ranks would wait in the broadcast)."""
    import os

    from trainguard.cli import main

    fw, cp, root, _ = _saved(tmp_path, monkeypatch)
    assert signed.write_mark(root / "step00000010", STABLE, {"stable_at_step": 12, "stable_after": 2}, KEY) is None
    # a rotation: the old key's marks signed anew for the manifest just verified; an unsigned checkpoint refused
    monkeypatch.setenv("TG_OLD", KEY.decode())
    monkeypatch.setenv("TG_NEW", "a-new-key-of-the-job-0123")
    os.unlink(root / "step00000005" / "manifest.hmac")
    assert main(["ckpt", "sign", str(root), "--key-env", "TG_NEW", "--old-key-env", "TG_OLD"]) == 1
    out = capsys.readouterr().out
    assert "step00000005: NOT SIGNED: it carries no signature of the old key" in out
    assert "step00000010: signed" in out and "marks signed: stable.json" in out
    new = CheckpointLayout(root, b"a-new-key-of-the-job-0123")
    assert new.tags() == ["step00000010", "step00000015"] and signed.stable(new, "step00000010")
    # a fresh start under the new key: every committed folder set aside, the unverifiable one too -- none deleted
    fw2, cp2, _ = _manager(tmp_path, monkeypatch, resume="none")
    cp2.key = b"a-new-key-of-the-job-0123"  # (the job's key is now the new one)
    assert cp2.resume_on_start() is None
    kept = sorted(p.name.split(".")[0] for p in (root / ".abandoned").iterdir())
    assert kept == ["step00000005", "step00000010", "step00000015"] and CheckpointLayout(root).committed() == []
    # a storage error on a stable mark: an io_error entry of rank 0's choice, never a raise before the broadcast
    for p in (root / ".abandoned").iterdir():
        os.replace(p, root / p.name.split(".")[0])
    real = listing.read_regular
    monkeypatch.setattr(listing, "IO_BACKOFF_S", 0.001)
    monkeypatch.setattr(listing, "read_regular", lambda p: (_ for _ in ()).throw(OSError(errno.EIO, "EIO", str(p)))
                        if Path(p).name == STABLE else real(p))
    tag, skipped, _ = cp2.choose(root, "stable")
    assert tag is None and skipped[-1]["io_error"] and "stable.json" in skipped[-1]["bad_file"]


def test_a_save_over_a_tag_holding_an_unverifiable_checkpoint_moves_it_aside_never_deletes_it(tmp_path, monkeypatch):
    """From the same review: a save of a tag whose folder holds a checkpoint this run's key does not verify (another
    key's, an old run's) deleted it with the replaced copy. It is moved to .abandoned/ first -- before the commit, so
    a failure there commits nothing -- and kept."""
    import os

    fw, cp, root, _ = _saved(tmp_path, monkeypatch, steps=(5, 10))
    os.unlink(root / "step00000010" / "manifest.hmac")  # (unsigned: not this run's to delete)
    (root / "step00000010" / "theirs.txt").write_text("another run's work")
    fw.steps = 10
    cp.save(root)
    assert CheckpointLayout(root, KEY).tags() == ["step00000005", "step00000010"]
    (kept,) = [p for p in (root / ".abandoned").iterdir() if p.name.startswith("step00000010.")]
    assert (kept / "theirs.txt").read_text() == "another run's work"


def test_a_signed_manifest_copied_into_another_folder_decides_nothing_there(tmp_path, monkeypatch):
    """From the review re-run: the listing took a verified manifest's step without checking that it is the folder's
    own. A writer copied the newest checkpoint's manifest and signature into an old folder: sorted as the newest's
    twin, the old folder was kept and an intact one deleted; a stable mark written over it bound to the copied
    manifest. Now a manifest naming another tag is passed over (named), and no mark is written over it."""
    fw, cp, root, _ = _saved(tmp_path, monkeypatch, steps=(5, 10, 15, 20), keep_last=3)
    assert CheckpointLayout(root, KEY).tags() == ["step00000010", "step00000015", "step00000020"]
    for name in ("manifest.json", "manifest.hmac"):
        (root / "step00000010" / name).write_bytes((root / "step00000020" / name).read_bytes())
    layout = CheckpointLayout(root, KEY)
    assert layout.tags() == ["step00000015", "step00000020"]
    assert "step00000020" in layout.unverified["step00000010"] and "not 'step00000010'" in \
        layout.unverified["step00000010"]
    fw.steps = 25
    cp.save(root)
    assert (root / "step00000015").is_dir(), "an intact checkpoint was deleted for a copied manifest's step"
    why = signed.write_mark(root / "step00000010", STABLE, {"stable_at_step": 22, "stable_after": 2}, KEY)
    assert why is not None and "step00000020" in why and not (root / "step00000010" / STABLE).exists()


def test_a_storage_error_on_the_newest_trainer_folder_stops_never_resumes_an_older_one(tmp_path, monkeypatch):
    """From the review re-run: under HF's Trainer (a ``checkpoint-N`` folder each), an EIO reading the newest
    folder's checkpoint was a refusal, and the next-older folder resumed (its progress then redone). Now the search
    stops there, naming the file: the caller fails closed."""
    import shutil

    from trainguard.checkpoint import manifest as manifest_mod
    from trainguard.checkpoint.resume import first_resumable

    fw, cp, root, _ = _saved(tmp_path, monkeypatch, steps=(5,))
    older, newer = tmp_path / "checkpoint-5", tmp_path / "checkpoint-10"
    shutil.copytree(root, older)
    shutil.copytree(root, newer)
    assert first_resumable([newer, older], "latest_valid", KEY) == (newer, [])
    monkeypatch.setattr(manifest_mod, "IO_BACKOFF_S", 0.001)
    real = manifest_mod.sha256_file

    def eio(path, *a, **k):
        if str(newer) in str(path):
            raise OSError(errno.EIO, "Input/output error", str(path))
        return real(path, *a, **k)

    monkeypatch.setattr(manifest_mod, "sha256_file", eio)
    chosen, refused = first_resumable([newer, older], "latest_valid", KEY)
    assert chosen is None and len(refused) == 1 and "checkpoint-10" in refused[0] and "Errno 5" in refused[0]


def test_a_planted_folder_in_place_of_the_suspect_file_is_no_crash(tmp_path):
    """From the review re-run: a directory planted as ``suspect_hosts.json`` in the log folder made the write fail
    (EISDIR) in the middle of a step, and rank 0 died of it. Now the alert still goes out, saying the file was not
    written (nothing then drains or excludes the host)."""
    from trainguard.recovery.suspects import SuspectWatch

    (tmp_path / "suspect_hosts.json").mkdir()
    (tmp_path / "suspect_hosts.json" / "x").write_text("planted")
    watch = SuspectWatch(1, 0, str(tmp_path / "events.jsonl"), lambda r: {"rank": r, "host": "node7"}, 2)
    emitted = []
    watch.suspect(12, 1, "test", lambda *a, **k: emitted.append((a, k)))
    detail = emitted[-1][0][4] if len(emitted[-1][0]) > 4 else emitted[-1][1].get("detail")
    assert detail["file"] is None and "suspect_hosts.json" in detail["file_error"], detail
    assert (tmp_path / "suspect_hosts.json" / "x").read_text() == "planted"


def test_an_older_signed_copy_of_a_tag_put_back_decides_nothing(tmp_path, monkeypatch):
    """From the review re-run: a signature says what was written, not when. A writer of a checkpoint's folder who
    kept its files (signed manifest and all) put them back after the run saved that tag again: every check passed,
    and a resume or rollback loaded the older state. Now each root keeps a signed index of what it last committed
    under each tag (in a 0700 folder of the job's own): an older copy is passed over and named; a key rotation
    carries the index over."""
    import shutil

    from trainguard.checkpoint.cli import ckpt_sign

    fw, cp, root, _ = _saved(tmp_path, monkeypatch)
    old = tmp_path / "kept-by-the-writer"
    shutil.copytree(root / "step00000015", old)
    fw.steps = 15
    cp.save(root)  # the same tag saved again (e.g. after a rollback took the run back there)
    assert (root / ".index").stat().st_mode & 0o777 == 0o700
    shutil.copytree(old, root / "step00000015", dirs_exist_ok=True)  # the older signed copy put back, file by file
    layout = CheckpointLayout(root, KEY)
    assert layout.tags() == ["step00000005", "step00000010"]
    assert "not the checkpoint last committed under this tag" in layout.unverified["step00000015"]
    tag, _, bad = choose_rollback(root, 16, "latest_valid", key=KEY)
    assert tag == "step00000010" and bad[0]["tag"] == "step00000015"
    from trainguard.checkpoint.manifest import verify

    res = verify(root / "step00000015", key=KEY)  # (a load of that tag by name verifies against the index too)
    assert not res.ok and "last committed" in res.reason
    # a key rotation: the index the old key signed is signed with the new one; the put-back copy stays passed over
    monkeypatch.setenv("NEW_KEY", "another-key")
    assert ckpt_sign(str(root), b"another-key", old_key=KEY) == 1  # (the put-back copy: NOT SIGNED, named)
    rotated = CheckpointLayout(root, b"another-key")
    assert rotated.tags() == ["step00000005", "step00000010"] and "step00000015" in rotated.unverified


def test_a_heartbeat_board_others_can_write_is_made_the_jobs_own_and_a_planted_beat_is_not_read(tmp_path):
    """From the review re-run: with ``watchdog.board: dir``, a folder others could write let them forge a beat (an
    old ``progress`` with a live rank's pid) and every rank exited as hung. Now the board folder is made 0700 (refused
    when it is a link or not a folder), and a beat is read only from a regular file of the job's user's own, never
    through a link."""
    import os

    from trainguard.errors import ConfigError
    from trainguard.liveness.watchdog import DirBoard, Heartbeat

    shared = tmp_path / "board"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    board = DirBoard(shared, world=2)
    assert shared.stat().st_mode & 0o777 == 0o700
    board.publish(Heartbeat(0).record())
    forged = tmp_path / "forged.json"
    forged.write_text((shared / "hb.rank0.json").read_text())
    (shared / "hb.rank1.json").symlink_to(forged)  # a beat planted through a link
    assert set(board.read()) == {0}
    (tmp_path / "a-file").write_text("")
    (tmp_path / "link").symlink_to(shared)
    (tmp_path / "open").mkdir()
    os.chmod(tmp_path / "open", 0o777)  # (others could rename the board away and back: refused)
    (tmp_path / "group").mkdir()
    os.chmod(tmp_path / "group", 0o775)  # (the job user's own, but a group may rename in it: refused too)
    for bad in (tmp_path / "a-file", tmp_path / "link", tmp_path / "open" / "board", tmp_path / "group" / "board"):
        with pytest.raises(ConfigError, match="watchdog.dir"):
            DirBoard(bad, world=2)
    os.chmod(tmp_path / "open", 0o1777)  # (sticky, as /tmp: none can rename the job's folder)
    assert DirBoard(tmp_path / "open" / "board", world=2).read() == {}


def test_the_fallback_snapshot_folders_of_processes_gone_are_removed_never_a_live_ones(tmp_path):
    """From the review re-run: the fallback folder (the per-user name squatted) had a random name per process and was
    never removed: each restart left a full set of snapshots in node memory until the tier ran out of room and the run
    stopped. Now a process holds a lock in its fallback folder while it lives; the next fallback removes those whose
    lock is free, and keeps a live process's."""
    import os
    import subprocess
    import sys

    taken = _squatted(tmp_path)
    code = ("import sys, time; from trainguard.checkpoint.private import expand; b = expand(sys.argv[1]); "
            "(b / 'shard').write_bytes(b'x' * 1024); print(b, flush=True); time.sleep(float(sys.argv[2]))")
    pattern = str(tmp_path / "trainguard-{uid}")
    live = subprocess.Popen([sys.executable, "-c", code, pattern, "60"], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[2])
    try:
        alive = Path(live.stdout.readline().strip())
        gone = Path(subprocess.run([sys.executable, "-c", code, pattern, "0"], capture_output=True, text=True,
                                   check=True, cwd=Path(__file__).resolve().parents[2]).stdout.strip())
        assert gone.is_dir() and alive.is_dir()
        from trainguard.checkpoint.private import expand

        mine = expand(pattern)
        assert not gone.exists(), "a restart's leftover was kept"
        assert alive.is_dir() and (alive / "shard").is_file(), "a live process's folder was removed"
        assert mine.is_dir() and mine not in (gone, alive)
    finally:
        live.kill()
        live.wait()


def test_a_huge_file_planted_as_a_manifest_is_passed_over_never_read_whole(tmp_path, monkeypatch):
    """From the third review: the manifest, its signature and the marks were read whole before the HMAC check -- a
    sparse 1 TB ``manifest.json`` took rank 0's memory at every listing (after every commit, at every resume). Now a
    file larger than any of its kind is refused on its size, a verdict (passed over), never read."""
    fw, cp, root, _ = _saved(tmp_path, monkeypatch)
    with open(root / "step00000015" / "manifest.json", "r+b") as f:
        f.truncate(100 << 20)  # (sparse: no disk used; 1 TB in the attack)
    real = listing.os.read
    read = []

    def counted(fd, n):
        block = real(fd, n)
        read.append(len(block))
        return block

    monkeypatch.setattr(listing.os, "read", counted)
    layout = CheckpointLayout(root, KEY)
    assert layout.tags() == ["step00000005", "step00000010"] and "step00000015" not in layout.digests
    assert sum(read) < (1 << 20), "the planted file was read"


def test_a_folder_planted_where_a_log_goes_is_no_stop_of_the_run(tmp_path):
    """From the fourth review: a folder (or a link, a FIFO) planted in the log folder where the JSONL or a rank's
    stack dump goes made the open fail at every start: the rank died on every attempt, and torchrun's restarts ran
    out without a hang marker. Now the log goes to a fresh file of the process's own beside it, said in the log; and
    a dir board below a folder others may write is refused however far up that folder is."""
    import os

    from trainguard.errors import ConfigError
    from trainguard.metrics.jsonl import JsonlSink
    from trainguard.liveness.watchdog import DirBoard, install_stack_dump_signal

    (tmp_path / "trainguard.jsonl").mkdir()
    (tmp_path / "stacks.rank0.txt").symlink_to(tmp_path / "elsewhere")
    sink = JsonlSink(tmp_path / "trainguard.jsonl")
    sink.metric(1, loss=1.0)
    sink.close()
    assert sink.path.parent == tmp_path and sink.path.name.startswith("trainguard.jsonl.") and sink.path.is_file()
    target = install_stack_dump_signal(tmp_path / "stacks.rank0.txt")
    assert target is not None and not (tmp_path / "elsewhere").exists()
    assert isinstance(target.name, str) and Path(target.name).parent == tmp_path  # (Watchdog.stop reads its name)
    target.close()
    (tmp_path / "shared").mkdir()
    os.chmod(tmp_path / "shared", 0o775)
    (tmp_path / "shared" / "mine").mkdir(mode=0o755)
    with pytest.raises(ConfigError, match="watchdog.dir"):
        DirBoard(tmp_path / "shared" / "mine" / "run1", world=2)


def test_a_file_planted_where_the_stacks_folder_goes_is_no_stop(tmp_path):
    """From the sixth review: with ``watchdog.stacks_dir`` set to a folder in the log folder, a file planted under
    that name made the folder's creation fail on every rank, at every start. Now the stacks go to stderr instead."""
    from trainguard.liveness.watchdog import install_stack_dump_signal

    (tmp_path / "stacks").write_text("planted")
    assert install_stack_dump_signal(tmp_path / "stacks" / "stacks.rank0.txt") is None  # (stderr: nothing to close)
    assert (tmp_path / "stacks").read_text() == "planted"
