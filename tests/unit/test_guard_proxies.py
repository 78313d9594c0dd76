"""The guard's host synchronisations on a healthy step, counted (issue 52's proxies, issue 55's "counted by a CI
test"): its one read -- of the agreed row (trainguard/step/agreement.py) -- taken at the update's launch, behind the
framework's own pre-step work (trainguard.step.launchgate), so none on the critical path; taken at the step's start
where the gate is not used (adaptive clipping), it is one; none grows with the model. Its added ATen ops per step: the
same whatever the number of parameters, and <= 30 (issue 52's goal: the local gradients checked where DeepSpeed reduces
them, one multi-tensor norm a call -- trainguard.step.gradhooks; 61 at 20 tensors and 441 at 400 with a hook a
parameter, 2026-12-06); its Python per parameter: none (the backward's constant few calls do not grow with the model).
The bench runs as a user runs it (its own process: it forms a process group).
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _proxies(tmp_path, *extra):
    out = tmp_path / "proxies.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "guard_proxies.py"), "--steps", "6", "--warmup", "3",
                           "--out", str(tmp_path), "--json", str(out), *extra], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode in (0, 1) and out.exists(), done.stdout[-2000:] + done.stderr[-2000:]
    assert "proxies: ops_small=" in done.stdout and ("missed" in done.stdout) == (done.returncode == 1)
    return json.loads(out.read_text())


@pytest.mark.parametrize("clipping, critical", [("deepspeed", 0), ("adaptive", 1)])
def test_a_healthy_step_reads_once_and_off_the_critical_path_where_it_decides_at_the_launch(tmp_path, clipping,
                                                                                             critical):
    got = _proxies(tmp_path, "--clipping", clipping)
    assert got["added_syncs"] == critical, got
    sites = got["sync_sites"]
    reads = {site: n for site, n in sites.items() if n >= 1}
    assert len(reads) == 1 and all(s.startswith("trainguard/step/agreement.py") for s in reads), sites
    assert all(" framework ops)" in s for s in reads) == (critical == 0), sites  # (behind the framework's own work)
    if clipping == "deepspeed":  # the same ops for 20 parameter tensors and for 400; no Python a parameter
        assert got["ops_small"] == got["ops_large"] <= 30, got
        assert got["py_calls_per_param"] == 0 and got["py_calls_per_backward"] <= 20, got
