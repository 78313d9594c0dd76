"""The guard's host synchronisations on a healthy step, counted (issue 52's proxies, issue 55's "counted by a CI
test"): one -- the AGREE read of the agreed table (trainguard/step/agreement.py) -- and none that grows with the model;
its added ATen ops per step: the same whatever the number of parameters, and <= 30 (issue 52's goal: the local
gradients checked where DeepSpeed reduces them, one multi-tensor norm a call -- trainguard.step.gradhooks; 61 at 20
tensors and 441 at 400 with a hook a parameter, 2026-12-06); its Python per parameter: none (the backward's constant
few calls do not grow with the model). The bench runs as a user runs it (its own process: it forms a process group).
"""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_healthy_step_adds_one_host_sync_where_it_is_said(tmp_path):
    out = tmp_path / "proxies.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "guard_proxies.py"), "--steps", "6", "--warmup", "3",
                           "--out", str(tmp_path), "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode in (0, 1) and out.exists(), done.stdout[-2000:] + done.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got["added_syncs"] == 1, got
    assert {site.split(":")[0] for site in got["sync_sites"]} == {"trainguard/step/agreement.py"}, got["sync_sites"]
    # the same ops for 20 parameter tensors and for 400, a handful of multi-tensor launches; no Python a parameter
    assert got["ops_small"] == got["ops_large"] <= 30, got
    assert got["py_calls_per_param"] == 0 and got["py_calls_per_backward"] <= 20, got
    assert "proxies: ops_small=" in done.stdout and ("missed" in done.stdout) == (done.returncode == 1)
