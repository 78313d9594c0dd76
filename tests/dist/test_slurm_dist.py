"""Through a real Slurm (issue 26 item 5): the job is submitted with ``sbatch scripts/launch/slurm_deepspeed.sbatch``
to a single-host Slurm 22.05 (tests/support/slurm.py), 2 DeepSpeed ranks under torchrun in the allocation.
Skipped, with the reason, where Slurm cannot run (not installed: scripts/get_slurm.sh; not root)."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import slurm
from trainguard.metrics.jsonl import read

pytestmark = [pytest.mark.dist]
if slurm.unavailable() is not None:
    from tests.support.require import unavailable

    unavailable("slurm", str(slurm.unavailable()), module=True)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = slurm.LocalSlurm(tmp_path_factory.mktemp("slurm")).start()
    yield c
    c.stop()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_hung_rank_is_requeued_by_slurm_without_the_suspect_host_and_resumes(tmp_path, cluster):
    """Rank 1 is the culprit of two non-finite steps on different data (steps 3, 5): suspect_rank, its host in
    suspect_hosts.json. At step 8 it hangs (SIGSTOP). The watchdog names it and every live rank exits 75; the
    sbatch script sees the hang marker, drains the suspect host (TRAINGUARD_DRAIN_SUSPECTS=1: the job may) with
    the reason, requeues the job and excludes the host from it: Slurm's own records carry both (read back with
    scontrol -- on one host they leave the job nowhere to run). Lifted, as after a node swap, the requeued job
    (SLURM_RESTART_COUNT=1) resumes from the newest checkpoint (step 6) and finishes all 16 steps, the replicas
    identical. (Seen failing before the script's fix: Slurm refuses a running job's ExcNodeList -- "Job is no
    longer pending execution" -- so the exclusion was never made.)"""
    out = tmp_path / "run"
    out.mkdir()
    cfg = tmp_path / "ds_config.json"
    cfg.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "steps_per_print": 1000000, "zero_optimization": {"stage": 2},
        "trainguard": {"allow_faults": True, "checks": {"enabled": False},
                       "checkpoint": {"dir": str(tmp_path / "ck"), "every_steps": 3, "stable_after": 1},
                       "distributed": {"watchdog": {"interval_s": 0.5, "hang_timeout_s": 5}},
                       "recovery": {"suspect_after": 2, "replay_check": False},
                       "faults": [{"type": "nan_loss", "step": 3, "rank": 1}, {"type": "nan_loss", "step": 5, "rank": 1},
                                  {"type": "hang_rank", "step": 8, "rank": 1}]}}))
    env = {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT),
           "NPROC_PER_NODE": "2", "MAX_RESTARTS": "0", "MASTER_PORT": str(_port()), "LOG_DIR": str(out),
           "TRAINGUARD_DRAIN_SUSPECTS": "1"}
    job = cluster.sbatch([
        "--nodes=1", "--ntasks-per-node=1", "--gpus-per-node=0", f"--cpus-per-task={os.cpu_count() or 2}",
        "--time=15", f"--output={out}/slurm-%j.out", "--open-mode=append", f"--chdir={ROOT}",
        str(ROOT / "scripts" / "launch" / "slurm_deepspeed.sbatch"),
        "-m", "trainguard.demo.worker", "--config", str(cfg), "--steps", "16", "--out", str(out)], env=env)
    node = cluster.node
    requeued = cluster.wait(job, lambda f: int(f.get("Restarts", 0)) >= 1 and f.get("JobState") == "PENDING",
                            timeout=240, release=False)
    assert requeued.get("ExcNodeList") == node, requeued
    assert json.loads((out / "suspect_hosts.json").read_text())["hosts"] == [node]
    drained = cluster.node_state()
    assert "DRAIN" in drained["State"] and "trainguard: suspect" in drained.get("Reason", ""), drained
    subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], env=cluster.env, check=True)
    subprocess.run(["scontrol", "update", f"JobId={job}", "ExcNodeList="], env=cluster.env, check=True)
    done = cluster.wait(job, lambda f: f.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"),
                        timeout=240)
    log = (out / f"slurm-{job}.out").read_text() if (out / f"slurm-{job}.out").exists() else ""
    assert done["JobState"] == "COMPLETED", log[-3000:]
    lines = read(out / "trainguard.jsonl")
    (suspect,) = [x for x in lines if x.get("event") == "suspect_rank"]
    assert suspect["ranks"] == [1] and suspect["detail"]["host"] == node
    (hang,) = [x for x in lines if x.get("event") == "hang_detected"]
    assert hang["ranks"] == [1]
    (restart,) = [x for x in lines if x.get("event") == "restart"]
    (resume,) = [x for x in lines if x.get("event") == "resume"]
    assert restart["detail"]["attempt"] == 1 and resume["detail"]["tag"] == "step00000006"
    results = [json.loads((out / f"result.rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["global_steps"] == 16 and r["weights_finite"] for r in results)
    assert results[0]["param_sha256"] == results[1]["param_sha256"]
    assert "requeueing job" in log and "a hang" in log
