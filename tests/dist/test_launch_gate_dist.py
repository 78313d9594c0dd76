"""Issue 52: "decide before applying" where the decision waits until the update's launch (trainguard.step.launchgate).
One rank, a real DeepSpeed engine per optimizer path the gate takes -- ZeRO-0 bf16 (DeepSpeed's FP16_UnfusedOptimizer),
ZeRO-0 fp32 (the torch optimizer itself), ZeRO-1 bf16 and ZeRO-2 fp32 (DeepSpeedZeroOptimizer) -- and one it does not
(ZeRO-3): a step the policy refuses (a force_action skip, the same path as a detector's) leaves the weights, the
master weights and the optimizer's moments bit-identical, DeepSpeed counts it skipped and its LR scheduler does not
step; the steps around it were decided at their launch and applied."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainguard.metrics.jsonl import read

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.dist


@pytest.mark.parametrize("stage, dtype, gated", [(0, "bf16", True), (0, "fp32", True), (1, "bf16", True),
                                                 (2, "fp32", True), (3, "bf16", False)])
def test_a_step_refused_at_its_launch_changes_nothing_and_is_counted_skipped(tmp_path, stage, dtype, gated):
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "support" / "gate_worker.py"), "--stage", str(stage),
                           "--dtype", dtype, "--steps", "5", "--skip", "3", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "overridden after learning rate scheduler" not in done.stderr  # (the scheduler's mark kept on the gate)
    steps = json.loads((tmp_path / "gate.json").read_text())
    (start,) = [x for x in read(tmp_path / "trainguard.jsonl") if x.get("event") == "run_start"]
    assert start["detail"]["decided_at"] == ("the update's launch" if gated else "the step's start")
    for s in steps:
        refused = s["step"] == 3
        # (a process's first step is decided at its start: no optimizer state yet to leave as it was)
        assert s["at_launch"] is (True if gated and s["step"] > 1 else None), s
        assert s["lr_stepped"] is (not refused), s
        if s["step"] > 1:  # (the optimizer's state exists from its first step on: ZeRO-3's lazily)
            assert s["changed"] is (not refused), s
        assert s["skipped_steps"] == (0 if s["step"] < 3 else 1) and s["global_steps"] == s["step"], s
