"""configs/prometheus/alerts.yml: valid for promtool when it is available, and always consistent
with the metric names the Prometheus sink serves."""
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

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


@pytest.mark.skipif(promtool() is None, reason="promtool not available (scripts/get_promtool.sh fetches it)")
def test_promtool_check_rules():
    res = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout
