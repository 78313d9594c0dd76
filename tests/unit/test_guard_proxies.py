"""The guard's host synchronisations on a healthy step, counted (issue 52's proxies, issue 55's "counted by a CI
test"): one -- the AGREE read of the agreed table (trainguard/agreement.py) -- and none that grows with the model;
its added ATen ops per step, at most the count bench/guard_proxies.py measured (a ratchet until the multi-tensor
check lands: issue 52's goal is <= 30 and the same for any number of parameters)."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def proxies():
    sys.path.insert(0, str(ROOT / "bench"))
    import guard_proxies

    return guard_proxies


def test_a_healthy_step_adds_one_host_sync_where_it_is_said(tmp_path, proxies):
    syncs = proxies.Syncs()
    try:
        small = proxies.measure(20, steps=6, warmup=3, out=tmp_path, syncs=syncs)
    finally:
        syncs.close()
    assert small["added_syncs"] == 1, small
    assert [site.split(":")[0] for site in syncs.where] == ["trainguard/agreement.py"], dict(syncs.where)
    assert small["ops"] <= 120, small  # (the count measured 2026-12-06: 6 a parameter tensor; never more)
