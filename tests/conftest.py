import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# DeepSpeed's CPU op is compiled once per machine and cached here (see scripts/setup.sh).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions"))
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def root() -> Path:
    return ROOT


# The support matrix's smoke (scripts/compat.sh): each test marked ``smoke("feature")`` reports its outcome under
# that feature to the JSON file TRAINGUARD_SMOKE_REPORT names (a feature passes when all its tests passed).
_SMOKE: dict = {}


def pytest_runtest_logreport(report):
    feature = _SMOKE_FEATURES.get(report.nodeid)
    if feature is None or (report.when != "call" and report.passed):
        return
    outcome = "skipped" if report.skipped else "passed" if report.passed else "failed"
    if report.passed:  # (a test may say more: record_property("smoke", "refused by name"))
        outcome = dict(report.user_properties).get("smoke", outcome)
    previous = _SMOKE.get(feature)
    if previous is None or previous == "passed" or outcome == "failed":
        _SMOKE[feature] = outcome


_SMOKE_FEATURES: dict = {}


def pytest_collection_modifyitems(items):
    for item in items:
        mark = item.get_closest_marker("smoke")
        if mark is not None:
            _SMOKE_FEATURES[item.nodeid] = mark.args[0] if mark.args else item.name


def pytest_sessionfinish(session):
    path = os.environ.get("TRAINGUARD_SMOKE_REPORT")
    if path:
        import json

        Path(path).write_text(json.dumps(_SMOKE, indent=1))
