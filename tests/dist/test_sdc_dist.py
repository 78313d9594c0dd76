"""Silent data corruption (issue 26, the replica check): one flipped bit in one data-parallel replica's
weights, under torchrun with real DeepSpeed engines at ZeRO-0 (every rank keeps and steps its own full
parameters, so nothing else ever reconciles them)."""
import pytest

from tests.dist.conftest import make_config

pytestmark = pytest.mark.dist

FLIP = [{"type": "bitflip", "step": 13, "rank": 1, "bit": 20}]


def _block(tmp_path, check: bool) -> dict:
    return {"checkpoint": {"dir": str(tmp_path / "ck"), "every_steps": 4, "stable_after": 2, "verify_steps": 0},
            "recovery": {"replay_check": False},
            "detectors": {"replica_check": {"enabled": check, "every_steps": 5}}}


def test_a_flipped_bit_in_one_replica_is_named_and_rolled_back(tmp_path, torchrun):
    """Without the check the two replicas train on with different weights to the end and nothing says so; with
    it (every 5 steps) the flip at step 13 is found at the check of step 15, both ranks of the 2-replica group are
    named (no majority to tell which), and the run rolls back to the newest stable checkpoint from before the
    last agreeing check (10): step 8. It ends with the replicas bit-identical again."""
    runs = {}
    for check in (False, True):
        d = tmp_path / ("on" if check else "off")
        d.mkdir()
        cfg = make_config(d, block=_block(d, check), faults=FLIP, zero_optimization={"stage": 0})
        runs[check] = torchrun(cfg, 24, out_name=f"run_{check}").ok()
    off, on = runs[False], runs[True]
    assert not [e for e in off.events if e["event"] in ("replica_mismatch", "rollback")]
    assert off.results[0]["param_sha256"] != off.results[1]["param_sha256"]  # (the corruption, silent)

    (mismatch,) = [e for e in on.events if e["event"] == "replica_mismatch"]
    assert mismatch["step"] == 15 and mismatch["action"] == "rollback"
    d = mismatch["detail"]
    assert d["majority"] is False and sorted(d["group"]) == [0, 1] and d["agreed_at"] == 10
    assert len(set(d["digests"].values())) == 2 and set(d["per_rank"]) == {"0", "1"}
    (rb,) = [e for e in on.events if e["event"] == "rollback"]
    assert rb["detail"]["anomaly"] == "replica_mismatch" and rb["detail"]["to_step"] == 8
    assert on.results[0]["param_sha256"] == on.results[1]["param_sha256"]
    assert all(r["global_steps"] == 24 and r["weights_finite"] for r in on.results)


def test_megatron_replicas_that_disagree_are_named_and_rolled_back(tmp_path):
    """The same check on megatron-core (DDP, DP=2): a bit of rank 1's first MLP weight flips at iteration 7; the
    check at 10 (every 5) finds the replicas apart, names both, and the run rolls back to the snapshot from before
    the last agreeing check (5): iteration 4. The replicas end bit-identical."""
    pytest.importorskip("megatron.core")
    from tests.dist.test_megatron_dist import run

    ck = tmp_path / "ck"
    block = {"checks": {"enabled": False}, "allow_faults": True,
             "checkpoint": {"dir": str(ck), "stable_after": 1, "verify_steps": 0},
             "detectors": {"replica_check": {"enabled": True, "every_steps": 5}},
             "faults": [{"type": "bitflip", "step": 7, "rank": 1, "bit": 20,
                         "param": "decoder.layers.0.mlp.linear_fc1.weight"}]}
    res, lines = run(tmp_path, "sdc", "dp", 14, block, ["--ckpt", str(ck), "--save-at", "4", "--save-at", "8"])
    (mismatch,) = [x for x in lines if x.get("event") == "replica_mismatch"]
    assert mismatch["step"] == 10 and mismatch["detail"]["agreed_at"] == 5 and mismatch["detail"]["majority"] is False
    (rb,) = [x for x in lines if x.get("event") == "rollback"]
    assert rb["detail"]["anomaly"] == "replica_mismatch" and rb["detail"]["to_step"] == 4
    assert res[0]["param_sha256"] == res[1]["param_sha256"] and all(r["weights_finite"] for r in res)
