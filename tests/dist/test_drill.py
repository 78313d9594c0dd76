"""The fire drill (issues 5 and 7): 1,000 steps, 2 ranks, ZeRO-2 fp16, a schedule of faults -- a
killed and a hung rank among them, under torchrun --max-restarts=2; trainguard against plain
DeepSpeed and a fault-free run with the same seeds and data.

A benchmark-length run (four 1,000-step runs: ~8 minutes on the 2-core machines of 2026-11-30,
past pytest's 600 s here): it runs when TRAINGUARD_DRILL=1, as does ``trainguard drill`` /
``python bench/fire_drill.py``; the suite's default run leaves it out (issue 15 asks for a short
drill that checks every row in its place)."""
import io
import json
import os

import pytest

from trainguard.drill import drill

pytestmark = [pytest.mark.dist, pytest.mark.timeout(1800),
              pytest.mark.skipif(os.environ.get("TRAINGUARD_DRILL") != "1",
                                 reason="the 1,000-step fire drill is a benchmark: TRAINGUARD_DRILL=1 runs it")]


def test_fire_drill(tmp_path):
    out = io.StringIO()
    rc, rows = drill(1000, tmp_path, stream=out)
    print(out.getvalue())
    by = {r["run"]: r for r in rows}
    clean, insured, tg, plain = (by[k] for k in ("clean (no faults)", "trainguard, no faults", "trainguard",
                                                 "plain DeepSpeed"))
    # with no fault, the guard changes nothing: the same final loss, to the last bit
    assert clean["completed"] and insured["completed"] and insured["eval_loss"] == clean["eval_loss"]
    # under the faults trainguard finishes, within 2% of the clean loss ...
    assert tg["completed"] and abs(tg["loss_vs_clean"]) <= 0.02
    # ... having rolled back (past the corrupted checkpoint), fallen back from fp16 to bf16, been restarted
    # after the killed rank and after the hung one (named: rank 0), resuming by itself each time
    assert tg["rollbacks"] >= 4 and tg["checkpoint_invalid"] >= 1 and tg["precision_fallback"]
    assert tg["restarts"] == 2 and tg["hangs_named"] == [0]
    # while DeepSpeed alone does not finish: it stops at the minimum loss scale, or -- restarted by
    # torchrun after the killed rank, without a fresh store prefix -- its workers hang or fail at the
    # rendezvous (all three seen on this machine); the row says which
    assert not plain["completed"] and plain["died"]
    # goodput is measured for every run (the 0.97 goal is not met at this fault density on CPU:
    # see the README's drill section; this bounds a regression)
    assert 0.3 < tg["goodput"] < insured["goodput"] <= clean["goodput"] <= 1.0
    assert rc == (0 if tg["goodput"] >= 0.97 else 1)
    saved = json.loads((tmp_path / "drill.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(rows))
