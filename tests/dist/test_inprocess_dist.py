"""Issue 38, first part: the launch and the world. Under torchrun, each worker is a supervisor (trainguard.supervise)
whose child is the training process; a SIGKILLed training process leaves the job running, a hot spare takes its
rank, the survivors form the world again (trainguard.world) and go on in the same processes. With no spare left,
the job falls back to torchrun's whole-job restart and says so. Plain torch.distributed on gloo
(tests/support/inprocess_worker.py); the adapters' restore from node memory is the next part."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).resolve().parents[1] / "support" / "inprocess_worker.py"
EXPECTED = [180.0] * 4  # 30 steps of (1 + 2 + 3): whatever was killed, every rank ends where a clean run ends


def _launch(out: Path, nproc: int, spares: int, max_restarts: int, **env) -> subprocess.CompletedProcess:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--max-restarts",
           str(max_restarts), "--monitor-interval", "0.1", "-m", "trainguard.supervise", "--spares", str(spares),
           "--", str(WORKER), str(out)]
    return subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", **env}, capture_output=True, text=True,
                          timeout=180)


def _read(out: Path, name: str) -> dict:
    return json.loads((out / name).read_text())


def test_a_killed_rank_is_replaced_by_a_spare_and_the_survivors_keep_their_processes(tmp_path):
    res = _launch(tmp_path, nproc=4, spares=1, max_restarts=0, KILL_RANK="1", KILL_STEP="10")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "rank 1's training process" in res.stderr and "spare 0 takes rank 1, generation 1" in res.stderr
    ends = {r: _read(tmp_path, f"end_rank{r}.json") for r in range(3)}
    assert all(e["x"] == EXPECTED and e["step"] == 30 and e["generation"] == 1 for e in ends.values()), ends
    for r in (0, 2):  # the survivors: the same processes from start to end, the world formed again once
        assert ends[r]["pid"] == _read(tmp_path, f"start_rank{r}_active.json")["pid"] and ends[r]["role"] == "active"
        assert len(ends[r]["reformed_s"]) == 1 and ends[r]["reformed_s"][0] < 20, ends[r]
    # rank 1 ended in the spare's process, not in the one that was killed
    assert ends[1]["role"] == "spare" and ends[1]["pid"] == _read(tmp_path, "start_rank1_spare.json")["pid"]
    assert ends[1]["pid"] != _read(tmp_path, "start_rank1_active.json")["pid"]


def test_with_no_spare_left_the_whole_job_restarts_and_says_so(tmp_path):
    res = _launch(tmp_path, nproc=3, spares=0, max_restarts=1, KILL_RANK="1", KILL_STEP="10")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "no spare is left: the whole job stops and restarts" in res.stderr
    ends = {r: _read(tmp_path, f"end_rank{r}.json") for r in range(3)}
    assert all(e["x"] == EXPECTED and e["attempt"] == 1 and e["generation"] == 0 for e in ends.values()), ends


def test_a_spare_never_needed_ends_with_the_job(tmp_path):
    res = _launch(tmp_path, nproc=3, spares=1, max_restarts=0)
    assert res.returncode == 0, res.stderr[-3000:]
    ends = {r: _read(tmp_path, f"end_rank{r}.json") for r in range(2)}
    assert all(e["x"] == [90.0] * 4 and e["generation"] == 0 for e in ends.values()), ends  # 30 steps of (1 + 2)
    assert not list(tmp_path.glob("*spare*"))
