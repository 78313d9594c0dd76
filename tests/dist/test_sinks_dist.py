"""Extension points reached from the block (issue 12), in a real 2-rank DeepSpeed run: a user
callback named in the block receives the NaN record; the W&B sink in offline mode writes the
run's metrics (read back from its run file)."""
import json

import pytest

from tests.dist.conftest import make_config
from tests.support.require import imported

pytestmark = pytest.mark.dist


def test_callback_gets_the_nan_record_and_wandb_offline_has_the_metrics(tmp_path, torchrun, monkeypatch):
    imported("wandb")  # (the [wandb] extra, which CI installs: its absence fails there, never a green skip)
    from tests.support.wandb_reader import history

    calls = tmp_path / "callback.jsonl"
    monkeypatch.setenv("TG_CALLBACK_OUT", str(calls))
    monkeypatch.setenv("WANDB_SILENT", "true")
    block = {"callbacks": ["tests.support.callbacks:to_file"],
             "metrics": {"per_rank": True, "wandb": {"project": "trainguard-test", "mode": "offline",
                                                     "dir": str(tmp_path)}}}
    cfg = make_config(tmp_path, block=block, faults=[{"type": "nan_loss", "step": 5, "rank": 1}],
                      bf16={"enabled": True})
    run = torchrun(cfg, 12).ok()
    got = [json.loads(line) for line in calls.read_text().splitlines()]
    (nan,) = [r for r in got if r["event"] == "nonfinite"]  # rank 0 calls back, once per record
    assert nan["step"] == 5 and nan["ranks"] == [1] and nan["action"] == "skip_step"
    assert [r["event"] for r in got] == [e["event"] for e in run.events]  # every record, in order
    (run_file,) = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    rows = history(run_file)
    metric_rows = [r for r in rows if "trainguard/loss" in r or "trainguard/applied" in r]
    assert [r["trainguard/step"] for r in metric_rows] == [m["step"] for m in run.metrics] == list(range(1, 13))
    by_step = {r["trainguard/step"]: r for r in metric_rows}
    for m in run.metrics:
        if m["loss"] is not None:
            assert by_step[m["step"]]["trainguard/loss"] == pytest.approx(m["loss"])
    assert by_step[5]["trainguard/applied"] == 0.0 and by_step[6]["trainguard/applied"] == 1.0
    assert any(r.get("trainguard/events/nonfinite") == 1 and r["trainguard/step"] == 5 for r in rows)
