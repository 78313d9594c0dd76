"""Compound faults: the drill's faults two at a time (DeepSpeed ZeRO-2 bf16 under torchrun, the demo's TinyGPT). Each
pair either survives -- the run reaches its last step with finite weights, bit-identical to an uninterrupted run where
nothing was skipped -- or ends in a clean, named abort with nothing lost. docs/liveness.md has a row per pair."""
import pytest

from tests.dist.conftest import make_config
from tests.dist.test_inprocess_dist import _deepspeed
from trainguard.demo.run import run_worker

pytestmark = pytest.mark.dist

STEPS = 24
RESTART = ["--max-restarts=1", "--monitor-interval=0.5"]


def block(tmp_path, **more):
    return {"metrics": {"per_rank": True},
            "checkpoint": {"dir": str(tmp_path / "ck"), "every_steps": 5, "stable_after": 2},
            "distributed": {"collective_timeout_s": 120, "watchdog": {"interval_s": 0.5, "hang_timeout_s": 5}}, **more}


def events(run, name):
    return [e for e in run.events if e["event"] == name]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    from tests.dist.conftest import Run

    tmp = tmp_path_factory.mktemp("uninterrupted")
    cfg = make_config(tmp, block=block(tmp), bf16={"enabled": True})
    rc, results = run_worker(cfg, tmp / "clean", STEPS, nproc=2, timeout=240)
    return Run(rc, results, tmp / "clean").ok()


def _run(tmp_path, torchrun, faults, **more):
    cfg = make_config(tmp_path, block=block(tmp_path, **more), faults=faults, bf16={"enabled": True})
    return torchrun(cfg, STEPS, launcher=RESTART, out_name="run").ok()


@pytest.mark.long  # (a whole-job restart and resume, as test_elastic_dist's SIGKILL test; CI keeps the kill inside a rollback and the spare's death)
def test_two_ranks_killed_at_once_restart_and_resume_exactly(tmp_path, torchrun, uninterrupted):
    run = _run(tmp_path, torchrun, [{"type": "kill_rank", "step": 18, "rank": r} for r in (0, 1)])
    (restart,) = events(run, "restart")
    assert restart["detail"]["attempt"] == 1
    assert events(run, "resume")[-1]["detail"]["tag"] == "step00000015"
    assert all(r["global_steps"] == STEPS for r in run.results)
    assert run.results[0]["param_sha256"] == run.results[1]["param_sha256"] == uninterrupted.results[0]["param_sha256"]


@pytest.mark.long  # (the short fire drill and test_elastic_dist's node-memory case make the same claim; CI's time)
def test_a_corrupted_newest_checkpoint_and_a_kill_resume_from_the_one_before(tmp_path, torchrun, uninterrupted):
    run = _run(tmp_path, torchrun, [{"type": "corrupt_checkpoint", "step": 15, "rank": 0},
                                    {"type": "kill_rank", "step": 18, "rank": 1}])
    assert [e["detail"]["tag"] for e in events(run, "checkpoint_invalid")][:1] == ["step00000015"]
    assert events(run, "resume")[-1]["detail"]["tag"] == "step00000010"
    assert run.results[0]["param_sha256"] == run.results[1]["param_sha256"] == uninterrupted.results[0]["param_sha256"]


@pytest.mark.long  # (a restart and a skip, each CI-tested alone; CI's time)
def test_a_nan_on_the_step_after_a_restart_is_skipped(tmp_path, torchrun):
    """Rank 1 dies at the start of step 16; the restarted job resumes from 15 and meets a NaN loss on rank 0 at 16,
    its first step: skipped (every rank), the run goes on to its end."""
    run = _run(tmp_path, torchrun, [{"type": "kill_rank", "step": 16, "rank": 1},
                                    {"type": "nan_loss", "step": 16, "rank": 0}])
    (restart,) = events(run, "restart")
    after = [e for e in events(run, "nonfinite") if e["time"] > restart["time"]]
    assert [(e["step"], e["action"], e["ranks"]) for e in after] == [(16, "skip_step", [0])]
    assert all(r["global_steps"] == STEPS and r["weights_finite"] for r in run.results)
    assert run.results[0]["param_sha256"] == run.results[1]["param_sha256"]


def test_a_kill_during_a_rollbacks_load_restarts_and_the_rollback_is_taken_again(tmp_path, torchrun):
    """A rollback decided at 17 (forced), rank 1 killed inside its load: the job restarts from the newest checkpoint
    (15; nothing was set aside -- the abandoned trajectory moves only after a load succeeded), meets the same decision
    at 17 and rolls back, then reaches its end."""
    run = _run(tmp_path, torchrun, [{"type": "force_action", "step": 17, "action": "rollback_newest"},
                                    {"type": "kill_rank", "step": 17, "rank": 1, "during": "rollback"}])
    (restart,) = events(run, "restart")
    assert events(run, "resume")[-1]["detail"]["tag"] == "step00000015"
    (rb,) = [e for e in events(run, "rollback") if e["time"] > restart["time"]]
    assert rb["step"] == 17 and rb["detail"]["to_tag"] == "step00000015"
    assert all(r["global_steps"] == STEPS and r["weights_finite"] for r in run.results)
    assert run.results[0]["param_sha256"] == run.results[1]["param_sha256"]


@pytest.mark.long  # (~90 s: a replacement and a whole-job restart, each CI-tested alone -- test_inprocess_dist; CI's time)
def test_a_spare_that_dies_after_taking_a_rank_falls_back_to_a_whole_job_restart(tmp_path):
    """3 ranks and one spare: rank 1 killed at 9 (the spare takes it, generation 1), then the spare itself -- rank 1 of
    generation 1 -- killed at 14: no spare is left, so the whole job restarts (torchrun --max-restarts 1) and resumes
    from the newest snapshot; the run ends with the parameters an uninterrupted run ends with."""
    from tests.dist.test_inprocess_dist import STEPS as IP_STEPS

    faults = [{"type": "kill_rank", "step": 9, "rank": 1}, {"type": "kill_rank", "step": 14, "rank": 1, "generation": 1}]
    rc, results, out, evs = _deepspeed(tmp_path, "spare_dies", 4, supervise=1, max_restarts=1, faults=faults)
    log = (out / "torchrun.log").read_text()
    assert rc == 0 and all(results), log[-3000:]
    assert "spare 0 takes rank 1, generation 1" in log and "no spare is left" in log
    assert [e["detail"]["rank"] for e in evs if e["event"] == "rank_replaced"] == [1]
    assert [e["detail"]["attempt"] for e in evs if e["event"] == "restart"] == [1]
    assert all(r["global_steps"] == IP_STEPS and r["weights_finite"] for r in results)
    _, clean, _, _ = _deepspeed(tmp_path, "clean", 3)
    assert [r["param_sha256"] for r in results] == [c["param_sha256"] for c in clean]
