"""Checkpoints under torchrun with real DeepSpeed engines: exact resume at every ZeRO stage, the
self-test after resume, fallback past a corrupt newest checkpoint, and no torn checkpoint after a
SIGKILL at random moments during saves."""
import json
import os
import random
import signal
import shutil
import subprocess
import sys
import time

import pytest

from tests.dist.conftest import make_config
from trainguard.checkpoint.layout import CheckpointLayout
from trainguard.checkpoint.manifest import Manifest, verify
from trainguard.demo.run import kill_tree, torchrun_env, worker_pids

pytestmark = pytest.mark.dist

N = 8


def ckpt_block(d, **kw):
    return {"checkpoint": {"dir": str(d), "every_steps": N, "verify_steps": 3, "stable_after": 4, **kw}}


# every ZeRO stage once; async at stage 2 (the suite's time: stage 3 async and stage 2 sync ran here before and
# are covered by the same code paths -- the async writer is stage-agnostic, stage 2 sync by the recovery tests)
# (ZeRO-1 passed here too and is left out for the suite's time: its optimizer is ZeRO-2's class)
@pytest.mark.parametrize("stage, async_save", [
    # (ZeRO-0: its module-only checkpoint is resumed exactly by the SIGKILL and elastic tests too -- long, 30 s)
    pytest.param(0, False, marks=pytest.mark.long), (3, False), pytest.param(2, True, marks=pytest.mark.smoke("resume"))])
def test_resume_is_exact_and_verified(tmp_path, torchrun, stage, async_save):
    """2N steps straight == N steps, save, (4 more steps then 'crash'), new processes, resume, N more:
    identical parameters and losses; the resume checks itself against the recorded trajectory. With
    dropout: the RNG restore is part of what is checked (without it the resumed dropout masks differ;
    seen failing with trainguard.checkpoint.rng.restore made a no-op)."""
    dtype = "bf16" if stage in (1, 3) else "fp32"
    (tmp_path / "a").mkdir()
    straight_cfg = make_config(tmp_path / "a", block=ckpt_block(tmp_path / "ckA"), zero_optimization={"stage": stage})
    straight = torchrun(straight_cfg, 2 * N, "--dtype", dtype, "--dropout", "0.1", out_name="straight").ok()

    (tmp_path / "b").mkdir()
    cfg = make_config(tmp_path / "b", block=ckpt_block(tmp_path / "ckB", **{"async": async_save}),
                      zero_optimization={"stage": stage})
    first = torchrun(cfg, N + 4, "--dtype", dtype, "--dropout", "0.1", out_name="first").ok()  # saves at N, dies at N+4
    assert CheckpointLayout(tmp_path / "ckB").tags() == [f"step{N:08d}"]
    if stage > 0:  # (DeepSpeed's recovery script beside its tags, where it would be without trainguard: issue 53)
        assert (tmp_path / "ckB" / "zero_to_fp32.py").is_file() and not (tmp_path / "ckB" / ".staging").exists()
    resumed = torchrun(cfg, 2 * N, "--dtype", dtype, "--dropout", "0.1", out_name="resumed").ok()  # resumes at N

    assert all(r["first_step"] == N for r in resumed.results)
    for a, c in zip(straight.results, resumed.results):
        assert c["param_sha256"] == a["param_sha256"]                 # identical parameters
        assert c["losses"] == a["losses"][N:2 * N]                     # identical losses, step by step
    assert first.results[0]["losses"][N:N + 4] == straight.results[0]["losses"][N:N + 4]
    (res,) = [e for e in resumed.events if e["event"] == "resume"]
    assert res["detail"]["tag"] == f"step{N:08d}" and res["detail"]["fell_back_past"] == []
    # every file DeepSpeed loaded on rank 0 came from bytes checked against the manifest (issue 25 item 7):
    # the module states, and its ZeRO optimizer partition where there is one
    assert res["detail"]["verified_on_load"] >= (1 if stage == 0 else 2)
    # (the periodic one; the first step's goes to dir/.first: checkpoint.first_step)
    (saved,) = [e for e in first.events if e["event"] == "checkpoint_saved" and not e["detail"]["dir"].endswith(".first")]
    assert saved["detail"].get("async", False) == async_save
    if async_save:
        assert saved["detail"]["blocking_s"] <= saved["detail"]["total_s"]
    # the first step's checkpoint, the insurance, is written in the background whatever `async` says (issue 52: off
    # the step's critical path -- its blocking part the host copy), committed and listed in dir/.first
    (insured,) = [e for e in first.events if e["event"] == "checkpoint_saved" and e["detail"]["dir"].endswith(".first")]
    assert insured["step"] == 1 and insured["detail"]["async"] and insured["detail"]["tag"] == "step00000001"
    assert insured["detail"]["blocking_s"] <= insured["detail"]["total_s"]
    (ok,) = [e for e in resumed.events if e["event"] in ("resume_verified", "resume_discontinuity")]
    assert ok["event"] == "resume_verified" and ok["detail"]["max_rel_diff"] == 0.0
    assert [s["step"] for s in ok["detail"]["steps"]] == [N + 1, N + 2, N + 3]


def test_a_failed_background_write_stays_invisible_and_training_goes_on(tmp_path, torchrun):
    """An async save whose write fails on one rank (a full disk: the checkpoint_write_error fault on
    rank 1): every rank gives up on it at once -- rank 0 does not wait out its 30-minute timeout for
    rank 1's files -- it never becomes visible, ``checkpoint_failed`` names the rank and the error, the
    run finishes and the next save commits."""
    d = tmp_path / "ck"
    cfg = make_config(tmp_path, block={"checkpoint": {"dir": str(d), "every_steps": 4, "async": True}},
                      bf16={"enabled": True}, faults=[{"type": "checkpoint_write_error", "step": 8, "rank": 1}])
    run = torchrun(cfg, 12, timeout=180).ok()
    (failed,) = [e for e in run.events if e["event"] == "checkpoint_failed"]
    assert failed["detail"]["failures_in_a_row"] == 1  # (three in a row: an error in the log, not silence)
    assert failed["detail"]["tag"] == "step00000008"
    assert "rank 1" in failed["detail"]["error"] and "No space left on device" in failed["detail"]["error"]
    layout = CheckpointLayout(d)
    assert layout.tags() == ["step00000004", "step00000012"]
    assert all(verify(layout.tag_dir(t)).ok for t in layout.tags())
    assert [e["detail"]["tag"] for e in run.events if e["event"] == "checkpoint_saved"] == \
        ["step00000001", "step00000004", "step00000012"]  # (1: the first step's, in dir/.first)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "trainguard.cli", "ckpt", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def test_corrupt_or_truncated_newest_is_named_and_skipped(tmp_path, torchrun):
    d = tmp_path / "ck"
    cfg = make_config(tmp_path, block=ckpt_block(d), bf16={"enabled": True})
    torchrun(cfg, 2 * N, out_name="make").ok()
    layout = CheckpointLayout(d)
    old, new = layout.tags()
    assert run_cli("verify", d).returncode == 0
    newest = layout.tag_dir(new)
    files = sorted(Manifest.read(newest).files)
    assert len(files) >= 5  # model, 2 optimizer partitions, 2 rank sidecars, guard state

    # every single file of the newest checkpoint: flip one byte, or truncate it -> named by verify
    for rel in files:
        p = newest / rel
        original = p.read_bytes()
        for damage in ("flip", "truncate"):
            if damage == "flip":
                pos = random.Random(rel).randrange(len(original))
                p.write_bytes(original[:pos] + bytes([original[pos] ^ 0x01]) + original[pos + 1:])
            else:
                p.write_bytes(original[: len(original) // 2])
            res = run_cli("verify", d, new)
            assert res.returncode == 1 and rel in res.stdout, (rel, damage, res.stdout)
            p.write_bytes(original)
    assert run_cli("verify", d).returncode == 0

    # corrupt the newest for real; a new run resumes from the previous one, with an event naming the file
    victim = next(f for f in files if "optim_states" in f)
    data = bytearray((newest / victim).read_bytes())
    data[len(data) // 3] ^= 0xFF
    (newest / victim).write_bytes(bytes(data))
    listing = run_cli("list", d)
    assert f"BAD: {victim}" in listing.stdout
    resumed = torchrun(cfg, 2 * N + 2, out_name="resume").ok()
    (res,) = [e for e in resumed.events if e["event"] == "resume"]
    assert res["detail"]["tag"] == old
    assert res["detail"]["fell_back_past"][0]["tag"] == new
    assert res["detail"]["fell_back_past"][0]["bad_file"] == victim
    assert [e["detail"]["bad_file"] for e in resumed.events if e["event"] == "checkpoint_invalid"] == [victim]
    assert all(r["first_step"] == N for r in resumed.results)


def test_stable_marks_and_retention(tmp_path, torchrun):
    """Checkpoints every 4 steps, stable after 4 quiet steps; a NaN at step 14 spoils the one at 12.
    Retention keeps the newest 2 plus the newest 2 stable ones; resume 'stable' takes the newest stable."""
    d = tmp_path / "ck"
    # (replay_check off: with it, a skipped NaN whose weights replay healthy was bad data, which spoils nothing)
    cfg = make_config(tmp_path, block={"checkpoint": {"dir": str(d), "every_steps": 4, "stable_after": 4,
                                                      "keep_last": 2, "keep_stable": 2, "verify_steps": 2},
                                       "recovery": {"replay_check": False}},
                      faults=[{"type": "nan_loss", "step": 14, "rank": 1}], bf16={"enabled": True})
    run = torchrun(cfg, 20).ok()
    layout = CheckpointLayout(d)
    tags = layout.tags()
    stable = [t for t in tags if (layout.tag_dir(t) / "stable.json").exists()]
    saved = [e["detail"]["tag"] for e in run.events if e["event"] == "checkpoint_saved"]
    assert saved == [f"step{s:08d}" for s in (1, 4, 8, 12, 16, 20)]  # (1: the first step's, in dir/.first)
    marked = [e["detail"]["tag"] for e in run.events if e["event"] == "checkpoint_stable"]
    assert marked == ["step00000004", "step00000008", "step00000016"]   # 12 was spoiled by the NaN at 14
    # after the save at 20: keep_last {16, 20} + the newest 2 stable {8, 16}; 4 and 12 deleted
    assert tags == ["step00000008", "step00000016", "step00000020"]
    assert stable == ["step00000008", "step00000016"]
    assert all(verify(layout.tag_dir(t)).ok for t in tags)

    stable_cfg = make_config(tmp_path, block={"checkpoint": {"dir": str(d), "resume": "stable"}},
                             bf16={"enabled": True})
    resumed = torchrun(stable_cfg, 22, out_name="resume").ok()
    (res,) = [e for e in resumed.events if e["event"] == "resume"]
    assert res["detail"]["tag"] == stable[-1]


# (the suite's time: each trial is a fresh 2-rank launch, ~15 s; the long test below runs 20 + 10)
KILL_TRIALS = int(os.environ.get("TRAINGUARD_KILL_TRIALS", "4"))


@pytest.mark.parametrize("async_save", [pytest.param(False, marks=pytest.mark.long), True])  # (sync: -m long, CI's time)
def test_sigkill_during_saves_never_leaves_a_torn_checkpoint(tmp_path, async_save):
    """SIGKILL a rank at random moments while the run saves every step; after each kill, every
    visible checkpoint verifies and the resume choice is a verified one. Then DeepSpeed loads it.
    At least half of the kills must land while a save is in flight. (CI's selection: 4 sync + 2 async
    trials -- fewer made the in-flight assertion flaky: 1 async kill missed a save in a run here; the
    in-flight rate over many trials is the `long` test below.)"""
    trials = KILL_TRIALS if not async_save else max(KILL_TRIALS // 2, 1)
    sigkill_trials(tmp_path, async_save, trials, min_in_flight=max(1, trials // 2))


@pytest.mark.long
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("async_save", [False, True])
def test_most_sigkills_land_while_a_save_is_in_flight(tmp_path, async_save):
    """Issue 25 item 15: 2 of 4 kills in flight is a weak claim. Over 20 sync / 10 async trials, at least 70%
    of the kills must land while a save is in flight (measured: 44 of 50). `pytest -m long` (~6 minutes);
    not in CI's default selection (pyproject: -m "not long")."""
    sigkill_trials(tmp_path, async_save, 20 if not async_save else 10, min_in_flight=14 if not async_save else 7)


def sigkill_trials(tmp_path, async_save: bool, trials: int, min_in_flight: int) -> None:
    d = tmp_path / "ck"
    cfg = make_config(tmp_path, block={"checkpoint": {"dir": str(d), "every_steps": 1, "keep_last": 2,
                                                      "verify_steps": 0, "async": async_save}},
                      bf16={"enabled": True})
    rnd = random.Random(1234 + async_save)
    staged_at_kill = resumable = 0
    for trial in range(trials):
        out = tmp_path / f"t{trial}"
        out.mkdir()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "trainguard.demo.worker", "--config", str(cfg), "--steps", "100000", "--out", str(out),
               "--d-model", "192", "--layers", "4"]
        with open(out / "log", "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=torchrun_env(),
                                    start_new_session=True)
            try:
                # wait until this launch has committed one save of its own, then until its next
                # save is in flight (staging holds it), then a random moment within the save
                events = out / "trainguard.jsonl"
                staging = d / ".staging"
                deadline = time.time() + 120
                while time.time() < deadline and proc.poll() is None:
                    if events.exists() and '"checkpoint_saved"' in events.read_text():
                        break
                    time.sleep(0.05)
                victims = worker_pids(proc.pid)  # (found before the save is watched: psutil takes its time)
                assert victims, f"trial {trial}: no worker to kill (log: {out / 'log'})"
                victim = rnd.choice(victims)
                time.sleep(rnd.uniform(0.0, 0.3))
                while time.time() < deadline and proc.poll() is None:
                    if staging.is_dir() and any(staging.iterdir()):
                        break
                    time.sleep(0.002)
                # a random moment within a synchronous save (the step waits for it: tens of ms); an async save's
                # background write of this small model is over in a few ms, so that kill comes at once (a random
                # delay made 0 of 2 async kills land in flight on a busy CI machine)
                if not async_save:
                    time.sleep(rnd.uniform(0.0, 0.04))
                staged_at_kill += staging.is_dir() and any(staging.iterdir())
                os.kill(victim, signal.SIGKILL)
                proc.wait(timeout=60)
            finally:
                kill_tree(proc.pid)   # torchrun's workers live in their own sessions
        layout = CheckpointLayout(d)
        for tag in layout.tags():
            res = verify(layout.tag_dir(tag))
            assert res.ok, f"trial {trial}: torn checkpoint {tag}: {res.bad_file}: {res.reason}"
        resumable += bool(layout.tags())
    print(f"\nSIGKILL trials ({'async' if async_save else 'sync'} saves): {trials}; a save was in flight at "
          f"{staged_at_kill} of the kills; torn checkpoints: 0; a verified resume target after every kill: "
          f"{resumable == trials}")
    assert resumable == trials
    # the point of the test: most kills landed while a save was being written (staging held it), and
    # none of them left a torn checkpoint behind (a test whose kills all missed the saves proves nothing)
    assert staged_at_kill >= min_in_flight, f"only {staged_at_kill} of {trials} kills hit a save in flight"
    # and DeepSpeed really loads the survivor, in new processes
    final = tmp_path / "final"
    from trainguard.demo.run import run_worker

    rc, results = run_worker(cfg, final, 0, extra=["--d-model", "192", "--layers", "4"], timeout=180)
    assert rc == 0 and all(r["first_step"] > 0 for r in results)
    events = [json.loads(x) for x in (final / "trainguard.jsonl").read_text().splitlines()]
    assert [e["detail"]["fell_back_past"] for e in events if e.get("event") == "resume"] == [[]]


@pytest.mark.parametrize("before, after", [pytest.param(2, 1, marks=pytest.mark.smoke("reshard")),
                                           pytest.param(1, 2, marks=pytest.mark.long)])  # (1->2: long, 25 s)
def test_resume_at_another_data_parallel_size(tmp_path, before, after, record_property):
    """Through DeepSpeed universal checkpoints (converted on demand): the run goes on at the new
    size with the same full fp32 master parameters and Adam moments as the source run saved, and the
    data position is re-split so that no sample is lost or repeated."""
    import torch

    from trainguard.demo.run import run_worker
    from trainguard.metrics.jsonl import read

    d = tmp_path / "ck"
    cfg = make_config(tmp_path, block={"checkpoint": {"dir": str(d), "every_steps": N}}, bf16={"enabled": True})
    rc, first = run_worker(cfg, tmp_path / "first", N, nproc=before, timeout=240, extra=["--state-digest"])
    assert rc == 0
    rc, second = run_worker(cfg, tmp_path / "second", N + 4, nproc=after, timeout=240, extra=["--state-digest"])
    import deepspeed

    from trainguard.support import releases

    if releases.feature_refusal("deepspeed", deepspeed.__version__, "reshard"):
        # DeepSpeed 0.16-0.17 load an Adam moment into the fp32 master weights (issue 32: seen on both, this test
        # without the refusal): the resume is refused by name, before anything is loaded, the checkpoint kept
        log = (tmp_path / "second" / "torchrun.log").read_text()
        assert rc != 0 and "trainguard will not resume" in log and "Adam moment into the fp32 master" in log
        assert (d / "step00000008" / "manifest.json").is_file()
        record_property("smoke", "refused by name")  # (scripts/compat.sh's table says so)
        return
    assert rc == 0, (tmp_path / "second" / "torchrun.log").read_text()[-3000:]
    # the state the source run saved at step N (its end) is the state the new size starts from, exactly
    saved = first[0]["state_at_end"]
    assert all(r["state_at_start"] == saved for r in second), (saved, [r["state_at_start"] for r in second])
    assert all(r["first_step"] == N and r["global_steps"] == N + 4 and r["weights_finite"] for r in second)
    (res,) = [e for e in read(tmp_path / "second" / "trainguard.jsonl") if e.get("event") == "resume"]
    resharded = res["detail"]["resharded"]
    assert (resharded["from_dp"], resharded["to_dp"]) == (before, after)
    # every file of the conversion DeepSpeed opened (the per-parameter fp32 and moment files among them) was read
    # once on the loading rank and matched against the conversion's verified manifest before torch.load saw it
    assert resharded["conversion_files_verified"] >= 3

    def ids(run_dir, world):
        out = []
        for r in range(world):
            for line in read(run_dir / f"trainguard.rank{r}.jsonl"):
                if line["type"] == "metric":
                    out += line["sample_ids"]
        return out

    seen = ids(tmp_path / "first", before) + ids(tmp_path / "second", after)
    consumed = N * 4 * before + 4 * 4 * after
    order = torch.randperm(4096, generator=torch.Generator().manual_seed(0)).tolist()
    assert len(seen) == len(set(seen)) == consumed          # nothing repeated
    assert sorted(seen) == sorted(order[:consumed])          # nothing lost: exactly the epoch's prefix


def test_an_authenticated_run_end_to_end_refuses_every_altered_file(tmp_path, torchrun, monkeypatch):
    """Issue 25 item 12, with real engines: with checkpoint.hmac_key_env, every disk checkpoint and every
    in-memory snapshot is signed; a rollback after the weights are damaged loads a signed snapshot (each rank
    checks the bytes it loads against the signed manifest); a restart passes over the newest checkpoint whose
    file an attacker replaced -- rewriting its sha256 in the manifest, which the HMAC catches -- and resumes
    from the one before; the user's own engine.load_checkpoint of the altered one is refused; and a job whose
    key was rotated stops instead of starting afresh."""
    from trainguard.checkpoint.manifest import Manifest, sha256_file

    monkeypatch.setenv("TG_E2E_KEY", "the-run-key-0123456789")
    d, shm = tmp_path / "ck", tmp_path / "shm"
    # disk checkpoints at 5, 10; snapshots at 2, 4, 6, 8; the weights damaged at 9: the newest stable state before
    # it is the snapshot of 6 (8 had no clean step after it), newer than the disk's 5
    block = {"checkpoint": {"dir": str(d), "every_steps": 5, "stable_after": 1, "verify_steps": 1, "keep_last": 4,
                            "hmac_key_env": "TG_E2E_KEY",
                            "snapshot": {"every_steps": 2, "dir": str(shm), "ranks_per_node": 1}}}
    cfg = make_config(tmp_path, block=block, bf16={"enabled": True},
                      faults=[{"type": "nan_weights", "step": 9, "rank": 1, "param": "blocks.1.mlp.0.weight"}])
    first = torchrun(cfg, 12, out_name="first").ok()
    (rb,) = [e for e in first.events if e["event"] == "rollback"]
    assert rb["detail"]["to_tag"] == "memory:step00000006"  # a signed snapshot of node memory, loaded and checked
    # every snapshot went to the peer on the other (simulated) node, whose copy verified with the key before commit
    saved = [e for e in first.events if e["event"] == "snapshot_saved"]
    assert saved and all(e["detail"]["peer"] == 1 for e in saved)
    assert not [e for e in first.events if e["event"] == "checkpoint_failed"]
    assert first.results[0]["param_sha256"] == first.results[1]["param_sha256"]
    layout = CheckpointLayout(d)
    assert layout.tags() and all((layout.tag_dir(t) / "manifest.hmac").is_file() for t in layout.tags())

    newest = layout.tags()[-1]
    victim = layout.tag_dir(newest) / "trainguard" / "rank0.pt"  # (any listed file: this one is small)
    victim.write_bytes(victim.read_bytes() + b"\0")
    man = Manifest.read(layout.tag_dir(newest))
    digest, size = sha256_file(victim)
    man.files["trainguard/rank0.pt"] = {"sha256": digest, "size": size}  # the attacker rewrites the sha256 ...
    man.write(layout.tag_dir(newest))                                      # ... but cannot sign it
    elsewhere = tmp_path / "elsewhere"  # (a copy for the explicit load below: the resume sets the original aside)
    shutil.copytree(layout.tag_dir(newest), elsewhere / newest)
    before = layout.tags()
    again = make_config(tmp_path, block={**block, "checkpoint": {**block["checkpoint"], "snapshot": {}}},
                        bf16={"enabled": True})
    resumed = torchrun(again, 8, out_name="resumed").ok()  # (to 8: no save re-signs the altered tag 10)
    (bad,) = [e for e in resumed.events if e["event"] == "checkpoint_invalid"]
    assert bad["detail"]["tag"] == newest and "HMAC mismatch" in bad["detail"]["reason"]
    (res,) = [e for e in resumed.events if e["event"] == "resume"]
    assert res["detail"]["tag"] == before[-2] and res["detail"]["verified_on_load"] >= 2

    explicit = torchrun(again, 0, "--load", f"{elsewhere}:{newest}", out_name="explicit")
    log = (explicit.out / "torchrun.log").read_text()
    assert explicit.rc != 0 and f"checkpoint {newest}" in log and "HMAC mismatch" in log

    monkeypatch.setenv("TG_E2E_KEY", "a-rotated-key-0123456789")  # every checkpoint now fails its signature: stop, move nothing
    listing = sorted(p.name for p in d.iterdir())
    rotated = torchrun(again, 12, out_name="rotated")
    log = (rotated.out / "torchrun.log").read_text()
    assert rotated.rc != 0 and "none can be loaded" in log and sorted(p.name for p in d.iterdir()) == listing


def _by_turns_on(rank: int, world: int, store: str, each: int, fail: int, out: str) -> None:
    """One rank of the test below: a load of ``each`` bytes through trainguard.checkpoint.hostroom.by_turns."""
    from pathlib import Path

    import torch.distributed as dist

    from trainguard.checkpoint.hostroom import by_turns

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        def load():
            began = time.time()
            time.sleep(0.5)
            if rank == fail:
                raise OSError("the load failed")
            return [began, time.time()]
        try:
            said = by_turns(each, load)
        except OSError as e:
            said = str(e)
        dist.barrier()  # (every rank came out: none waits in a collective the others never entered)
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(said))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("each, fail", [(1, -1), (2 ** 50, -1), (2 ** 50, 0)])
def test_the_ranks_of_a_node_load_by_turns_where_its_memory_cannot_hold_them_all(tmp_path, each, fail):
    """A restart from the first step's checkpoint: every data-parallel replica reads the weights the first one wrote,
    bytes then tensors (megatron_hooks: about twice the file each; 8 replicas on a node, 16 states at once). Where the
    node's memory cannot hold that (here: 2**50 bytes each), the ranks of the node load one after another -- their
    loads do not overlap --; where it can, at once (they overlap). A load that fails raises on its rank after the turns,
    and the other ranks' loads go on."""
    import torch.multiprocessing as mp

    mp.start_processes(_by_turns_on, args=(2, str(tmp_path / "store"), each, fail, str(tmp_path)), nprocs=2,
                       join=True, start_method="spawn")
    said = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    if fail == 0:
        assert said[0] == "the load failed" and isinstance(said[1], list), said
        return
    (a0, b0), (a1, b1) = said
    overlap = min(b0, b1) - max(a0, a1)
    assert (overlap > 0.2) is (each == 1), said
