"""configs/prometheus/alerts.yml: valid for promtool when it is available, and always consistent
with the metric names the Prometheus sink serves."""
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support.require import unavailable
from trainguard.metrics import prometheus as prom_module

RULES = Path(__file__).resolve().parents[2] / "configs" / "prometheus" / "alerts.yml"


def promtool():
    cache = Path(os.environ.get("TRAINGUARD_CACHE", Path.home() / ".cache" / "trainguard"))
    for cand in (os.environ.get("PROMTOOL"), shutil.which("promtool"), cache / "promtool" / "usr" / "bin" / "promtool"):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return str(cand)
    return None


def test_rules_structure_and_metric_names():
    doc = yaml.safe_load(RULES.read_text())
    rules = [r for g in doc["groups"] for r in g["rules"]]
    assert {r["alert"] for r in rules} >= {"TrainguardLossSpike", "TrainguardNonFinite", "TrainguardSkippedStepRateHigh",
                                           "TrainguardLossScaleAtFloor", "TrainguardAttentionEntropyCollapse",
                                           "TrainguardHeartbeatStale"}
    served = set(re.findall(r"^(trainguard_[a-z_]+)", prom_module.__doc__, re.M))
    served |= {"trainguard_grad_norm_clipped", "trainguard_skipped_steps_total", "trainguard_events_total"}
    for r in rules:
        assert r["labels"]["severity"] in ("warning", "critical") and r["annotations"]["summary"]
        for name in re.findall(r"trainguard_[a-z_]+", r["expr"]):
            assert name in served, f"{r['alert']} uses {name}, which the sink does not serve"


def needs_promtool() -> str:
    """promtool's path -- or a skip, which fails when TRAINGUARD_REQUIRE names promtool (CI: .ci/run)."""
    found = promtool()
    if found is None:
        unavailable("promtool", "promtool not available (scripts/get_promtool.sh fetches it)")
    return found


def test_promtool_check_rules():
    needs_promtool()
    res = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout


def scrape_of_a_troubled_run() -> dict[str, float]:
    """Feed trainguard's Prometheus sink what a troubled 2-rank run writes -- a metric line per step,
    the events it emits -- and scrape it: ``{series: value}`` as the exporter serves them."""
    import urllib.request

    from trainguard.metrics.prometheus import PrometheusSink

    sink = PrometheusSink(0, "127.0.0.1")
    try:
        for step in range(1, 21):
            skipped = step // 4  # a quarter of the steps not applied
            sink.metric(step, {
                "loss": 2.0, "loss_scale": 1.0, "loss_scale_min": 1.0,  # the fp16 scale sits at its floor
                "local_losses": [2.0, 2.0], "clocks": [1000.0 + step, 1000.0 + step],
                "compute_s": [0.1, 0.2], "straggler_ratio": [0.67, 1.33 + step / 20],  # rank 1: a straggler
                "executed_steps": step, "not_applied_steps": skipped,
                "attention_entropy_ratio_by_rank": {"0": {"blocks.1.attn.softmax": [0.9, 0.8]},
                                                    "1": {"blocks.1.attn.softmax": [0.9, 0.01]}}})
        for event in ("nonfinite", "instant_burst", "grad_surge", "grad_surge", "grad_surge"):
            sink.event(20, event, [1], None, {})
        body = urllib.request.urlopen(f"http://127.0.0.1:{sink.port}/metrics", timeout=5).read().decode()
    finally:
        sink.close()
    series = {}
    for line in body.splitlines():
        if line.startswith("trainguard_") and not line.split()[0].endswith("_created"):
            name, value = line.rsplit(" ", 1)
            series[name] = float(value)
    return series


def test_every_alert_fires_on_the_series_the_exporter_serves(tmp_path):
    """Issue 15 item 1: the rules were checked against the exporter's docstring, and
    TrainguardLossScaleAtFloor could never fire (nothing set trainguard_loss_scale_min). Here promtool
    evaluates every rule on series scraped from the sink itself: gauges held at their scraped value for
    20 minutes, step counters growing linearly to theirs, event counters jumping to theirs in the last
    5 minutes, heartbeats last set at the start (promtool's clock starts at 0: the ranks then stopped)
    -- and every alert must fire."""
    needs_promtool()
    scraped = scrape_of_a_troubled_run()
    assert scraped["trainguard_loss_scale_min"] == 1.0
    beats = [v for n, v in scraped.items() if n.startswith("trainguard_heartbeat_timestamp_seconds")]
    assert len(beats) == 2  # one per rank, each its own clock
    input_series = []
    for name, value in scraped.items():
        if name.startswith("trainguard_heartbeat_timestamp_seconds"):
            values = f"{value - max(beats)}x20"
        elif name.startswith("trainguard_events_total"):
            values = f"0x14 {value}x5"
        elif name.split("{")[0].endswith("_total"):
            values = f"0+{value / 20}x20"
        else:
            values = f"{value}x20"
        input_series.append({"series": name, "values": values})
    alerts = [r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    tests = {"rule_files": [str(RULES)], "evaluation_interval": "1m",
             "tests": [{"interval": "1m", "input_series": input_series,
                        "alert_rule_test": [{"eval_time": "20m", "alertname": a, "exp_alerts": []} for a in alerts]}]}
    spec = tmp_path / "tests.yml"
    spec.write_text(yaml.safe_dump(tests))
    res = subprocess.run([promtool(), "test", "rules", str(spec)], capture_output=True, text=True, timeout=60)
    # each test expects *no* alert: promtool then lists, per alert, what did fire -- every one must have
    out = res.stdout + res.stderr
    fired = {a for a in alerts if f"alertname: {a}" in out and "got:[" in out.split(f"alertname: {a}", 1)[1][:400]
             and "got:[]" not in out.split(f"alertname: {a}", 1)[1][:400]}
    assert fired == set(alerts), out[-4000:]


def test_a_persisting_alert_is_one_incident():
    """Issue 33: entropy_collapse written every 10 steps on both ranks for the rest of a run (14 records in 60
    steps). Now: one record opens the incident, the rest are folded in, one incident_closed says how many and how
    bad; a new episode after the gap is a new incident."""
    from trainguard.observe.incidents import Incidents

    book = Incidents(gap=30)
    heads = lambda r: {"heads": [{"rank": 0, "layer": "l0", "head": 1, "ratio": r}]}  # noqa: E731
    written = [s for s in range(100, 200, 10) for _ in (0,) if book.admit(s, "entropy_collapse", [s % 20 // 10],
                                                                          heads(0.05 - s / 10000))]
    assert written == [100]
    assert book.expire(220) == []                 # 30 steps after the last (190): still open
    (closed,) = book.expire(221)
    assert closed["count"] == 10 and closed["first_step"] == 100 and closed["last_step"] == 190
    assert closed["ranks"] == [0, 1] and closed["worst"] == {"entropy_ratio": pytest.approx(0.05 - 0.019)}
    assert book.admit(300, "entropy_collapse", [0], heads(0.01))["id"] == 2    # a new episode
    assert book.admit(301, "grad_surge", [1], {"z": 9.0})["id"] == 3           # another kind: its own
    assert book.admit(305, "grad_surge", [1], {"z": 40.0}) is None
    ends = book.expire(306, at_end=True)
    assert [(c["record"], c["worst"], c["open_at_end"]) for c in ends] == [
        ("entropy_collapse", {"entropy_ratio": 0.01}, True), ("grad_surge", {"z": 40.0}, True)]


def test_the_report_counts_the_alerts_folded_into_incidents():
    from trainguard.observe.summary import summarize

    lines = [{"type": "metric", "step": 1, "goodput": 1.0},
             {"type": "event", "step": 50, "event": "entropy_collapse", "ranks": [0], "action": "alert",
              "detail": {"incident": {"id": 1, "state": "opened"}}},
             {"type": "event", "step": 300, "event": "incident_closed", "ranks": [0, 1], "action": None,
              "detail": {"id": 1, "record": "entropy_collapse", "count": 14, "last_step": 300, "ranks": [0, 1]}},
             {"type": "event", "step": 300, "event": "run_end", "ranks": [0, 1], "action": None, "detail": {}}]
    (line,) = [x for x in summarize(lines).splitlines() if x.strip().startswith("entropy_collapse")]
    assert "x14" in line and "steps 50..300" in line and "(1 incident)" in line and "ranks [0, 1]" in line


def test_a_rollback_closes_open_incidents_and_rewinds_shared_failures():
    """A rollback sets the step counter back: a gap measured across it was negative, so the re-run's alerts were
    folded into the abandoned trajectory's incident and nothing expired until the run passed it again."""
    from trainguard.observe.incidents import Incidents
    from trainguard.recovery.suspects import SuspectWatch

    book = Incidents(gap=100)
    assert book.admit(500, "grad_surge", [0], {"z": 9.0})["state"] == "opened"
    (closed,) = book.expire(501, why="rollback")
    assert closed["closed_by"] == "rollback" and not book.open
    assert book.admit(210, "grad_surge", [0], {"z": 50.0})["id"] == 2  # the re-run's alert: written
    watch = SuspectWatch(2, rank=0, jsonl=None, coords_of=lambda r: {"rank": r}, world=2)
    watch.observe(500, {0: [1]}, lambda *a: None)
    watch.rewound(200)
    for step in (230, 240):  # rank 1 alone after the rollback, rank 0's failure is behind the rewound counter
        watch.observe(step, {1: [step]}, lambda *a: None)
    assert watch.suspected == {1}
