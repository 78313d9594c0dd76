"""Issue 37 on real engines: the summary way -- what every world above 64 ranks takes (trainguard.step.agreement) --
decides as the table way did. Two ranks forced onto it (TRAINGUARD_TABLE_UP_TO=0) with a NaN loss, a spiked batch
and an Inf activation: the same records, ranks, actions, samples and first bad module, and the same parameters."""
import pytest

from tests.dist.conftest import make_config

pytestmark = pytest.mark.dist

FAULTS = [{"type": "nan_loss", "step": 6, "rank": 1},
          {"type": "spike_batch", "step": 30, "rank": 1},
          {"type": "inf_activation", "step": 38, "rank": 0, "module": "blocks.1.mlp.0"}]
KEPT = ("nonfinite", "instant_burst", "slow_rise", "grad_surge", "fault_injected")


def _records(run):
    out = []
    for e in run.events:
        if e["event"] in KEPT:
            per_rank = e["detail"].get("per_rank", {})
            out.append((e["event"], e["step"], e["ranks"], e["action"],
                        {r: (d.get("sample_ids"), d.get("coords"), d.get("first_nonfinite_module"))
                         for r, d in per_rank.items() if isinstance(d, dict)}))
    return out


def test_the_summary_way_names_and_acts_as_the_table_way(tmp_path, torchrun, monkeypatch):
    cfg = make_config(tmp_path, faults=FAULTS)
    table = torchrun(cfg, 42, out_name="table").ok()
    monkeypatch.setenv("TRAINGUARD_TABLE_UP_TO", "0")
    summary = torchrun(cfg, 42, out_name="summary").ok()

    ways = [next(e for e in run.events if e["event"] == "run_start")["detail"]["agree"] for run in (table, summary)]
    assert [w["way"] for w in ways] == ["table", "summary"] and ways[1]["bytes_per_step"] < ways[0]["bytes_per_step"]
    want = _records(table)
    acted = [(r[0], r[1], r[2], r[3]) for r in want if r[3] not in ("alert", None)]
    assert acted == [("nonfinite", 6, [1], "skip_step"), ("instant_burst", 30, [1], "skip_step"),
                     ("nonfinite", 38, [0], "skip_step")], acted
    assert _records(summary) == want
    assert [r["param_sha256"] for r in summary.results] == [r["param_sha256"] for r in table.results]
    # the metric line: every rank's values in the table way, the extremes with their ranks in the summary way
    assert "local_losses" in table.metrics[-1] and "local_losses" not in summary.metrics[-1]
    line = summary.metrics[-1]
    assert line["local_loss_max"][1] in (0, 1) and line["compute_s_max"][1] in (0, 1)
    assert [m["loss"] for m in summary.metrics] == [m["loss"] for m in table.metrics]
