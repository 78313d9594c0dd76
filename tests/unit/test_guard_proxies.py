"""The guard's host synchronisations on a healthy step, counted (issue 52's proxies, issue 55's "counted by a CI
test"): one -- the AGREE read of the agreed table (trainguard/step/agreement.py) -- and none that grows with the model;
its added ATen ops per step: one norm a gradient (the tensor hook's) and a constant for the rest, whatever the
number of parameters (61 at 20 tensors, 441 at 400, measured 2026-12-06: a ratchet -- issue 52's goal is <= 30 and
the same for any number); its Python per parameter: the hook's one call (trainguard.step.tally.LocalGrads.add), plus the
backward's constant few. The bench runs as a user runs it (its own process: it forms a process group)."""
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
    # one op a gradient beyond a constant: the difference between the models is their 380 extra tensors, no more
    assert got["ops_small"] <= 61 and got["ops_large"] - got["ops_small"] <= 380, got
    assert got["py_calls_per_param"] <= 1.7, got  # (1 a gradient + 13 calls a backward over 20 tensors)
    assert "proxies: ops_small=" in done.stdout and ("missed" in done.stdout) == (done.returncode == 1)
