"""Recovery fuzzing in CI's selection: ``bench/recovery_fuzz.py --sample`` -- one seeded draw per stack, three of them in
CI (below), the rest with ``-m long`` (DeepSpeed ZeRO
0-3 fp16/bf16 with and without accumulation, HF's Trainer, megatron-core TP/PP/distributed optimizer, Megatron-LM's
pretrain_gpt.py TP/PP), each forcing one or two recovery actions at drawn steps of a healthy run. Every run must reach
its last step with finite weights, and what was forced must have been carried out (the long run of >= 200 draws keeps
its JSON under bench/results/)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.require import unavailable

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parents[2]


# CI's few stacks (both precisions, ZeRO-2 and -3, accumulation, Megatron-LM's own loop): the rest -- ZeRO 0/1, HF's
# Trainer, megatron-core's TP and distributed optimizer among them -- runs with -m long: CI's time (the kept 200 draws
# cover all 16)
CI = ("ds-z2-bf16-ga2", "ds-z3-fp16", "mlm-tp-fp16")


@pytest.mark.parametrize("half", ["ci", pytest.param("rest", marks=pytest.mark.long)])
def test_one_seeded_draw_per_stack_lives(tmp_path, half):
    sys.path.insert(0, str(ROOT))
    from bench.recovery_fuzz import STACKS, available

    assert set(CI) <= set(STACKS)
    chosen = [s for s in STACKS if (s in CI) == (half == "ci")]
    missing = {stack: why for stack in chosen if (why := available(stack))}
    here = [s for s in chosen if s not in missing]
    out = tmp_path / "fuzz.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "recovery_fuzz.py"), "--sample", "--seed", "50",
                           "--stacks", ",".join(here), "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    kept = json.loads(out.read_text())
    assert kept["draws"] == len(here) and kept["deaths_by_trainguard"] == 0
    assert sorted(d["stack"] for d in kept["every_draw"]) == sorted(here)
    for d in kept["every_draw"]:
        done = d["trainguard"]
        # (the first forced decision fired; a second may lie past the end of a loop that does not rewind after a
        # rollback -- HF's Trainer, a loop counting its own iterations -- and then never fires)
        assert d["lived"] and 1 <= done["forced"] <= len(d["forced"]), d
        if d["forced"][0]["action"] != "skip":  # (and it was carried out, or it was said why not)
            assert done["rollback"] + done["rollback_unavailable"] >= 1, d
    for stack, why in missing.items():  # (the stacks that could not run here: a skip, or under TRAINGUARD_REQUIRE a failure)
        unavailable("megatron_lm" if stack.startswith("mlm") else "megatron_releases", f"{stack}: {why}")
