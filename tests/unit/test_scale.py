"""Issue 37: the guard's healthy step does not cost more in a bigger world.

The summary a healthy step reduces (trainguard.ranks.reduced) gives the detectors what the table gave them; the simulated
step of bench/scale.py at 65,536 ranks meets the goals, and builds no per-rank object on a healthy step."""
from __future__ import annotations

import math
import random

import pytest
import torch

from bench import scale
from trainguard.step.agreement import Agreement, TABLE_UP_TO
from trainguard.ranks.isolation import FIELDS, F, observations
from trainguard.ranks.reduced import SUMS, Summary, as_floats, contribution, decode, keys, rank_bits
from tests.support.require import imported


def _random_rows(world: int, rng: random.Random, trial: int) -> list[list[float]]:
    rows = []
    for r in range(world):
        row = [0.0] * len(FIELDS)
        micro = rng.choice([0, 1, 2, 4]) if trial % 3 else 2           # (0: a pipeline stage without the loss)
        row[F["micro_batches"]] = micro
        row[F["loss_sum"]] = rng.uniform(-1, 5) * micro
        if trial % 5 == 1 and rng.random() < 0.2:
            row[F["loss_sum"]], row[F["loss_nonfinite"]] = float("nan"), 1
        row[F["grad_checked"]] = rng.choice([0, 3]) if trial % 4 == 2 else 3
        row[F["grad_sq"]] = rng.uniform(0, 100) if trial % 6 != 5 or rng.random() > 0.2 else float("inf")
        row[F["faults_fired"]] = float(rng.random() < 0.05)
        row[F["samples_rejected"]] = float(rng.random() < 0.05)
        row[F["lr"]], row[F["prev_grad_norm"]] = 1e-3 + r, 2.0 + r
        row[F["prev_applied_sq"]] = rng.uniform(0, 3)
        row[F["compute_s"]] = rng.uniform(0.1, 1.0) if trial % 7 else float("nan")
        row[F["clock"]] = 1.7e9 + rng.uniform(0, 5)
        rows.append(row)
    return rows


def test_the_reduced_summary_equals_the_one_of_every_ranks_row():
    """What two fixed-size all-reduces carry is what the detectors read from the table: the mean loss, the gradient
    proxy, the counts, rank 0's LR and norm, and each extreme with the rank that holds it (the lowest on a tie)."""
    rng = random.Random(0)
    for world in (1, 2, 3, 7, 64, 300):
        for trial in range(24):
            rows = _random_rows(world, rng, trial)
            bits = rank_bits(world)
            s, k = contribution(torch.tensor(rows, dtype=torch.float64), torch.arange(world), 4.0, 2.0, bits)
            read = torch.cat([s.sum(0).view(torch.int64), k.max(0).values]).tolist()
            got = Summary.reduced(as_floats(read[:len(SUMS)]), read[len(SUMS):], bits)
            want = Summary.of_rows(observations(rows, 4.0, 2.0))
            for name in got.__dataclass_fields__:
                a, b = getattr(got, name), getattr(want, name)
                if hasattr(a, "rank"):
                    assert a.rank == b.rank, (world, trial, name)
                    a, b = a.value, b.value
                if isinstance(a, float) and isinstance(b, float):
                    # (the reduction sums in another order; a non-finite gradient's proxy is NaN where the table's
                    # formula gave inf)
                    assert math.isclose(a, b, rel_tol=1e-9) or (math.isnan(a) and not math.isfinite(b)), \
                        (world, trial, name, a, b)
                else:
                    assert a == b, (world, trial, name, a, b)


def test_an_extremes_key_keeps_order_sign_and_the_lowest_rank_on_a_tie():
    values = torch.tensor([[-3.5], [0.0], [2.0], [2.0], [-0.0], [float("nan")], [1e300], [-1e300]], dtype=torch.float64)
    bits = rank_bits(len(values))
    k = keys(values, torch.arange(len(values)), bits)[:, 0]
    top, rank = decode(int(k.max()), bits)
    assert rank == 6 and math.isclose(top, 1e300, rel_tol=2 ** -40)  # (the key keeps 52 - bits of the mantissa)
    assert decode(int(k[[2, 3]].max()), bits) == (2.0, 2)           # a tie: the lowest rank, as argmax names it
    assert decode(int(k[[0, 7]].max()), bits)[1] == 0               # -3.5 > -1e300
    neg = keys(torch.tensor([[float("-inf")], [-2.5]], dtype=torch.float64), torch.arange(2), bits)[:, 0]
    assert decode(int(neg[0]), bits) == (float("-inf"), 0) and decode(int(neg[1]), bits) == (-2.5, 1)
    nan, nobody = decode(int(k[5]), bits)
    assert math.isnan(nan) and nobody is None                       # NaN is never an extreme


def test_the_way_is_the_table_up_to_64_ranks_and_the_summary_above(monkeypatch):
    assert Agreement(0, TABLE_UP_TO, torch.device("cpu")).way == "table"
    big = Agreement(0, TABLE_UP_TO + 1, torch.device("cpu"))
    assert big.way == "summary" and big.bytes_per_step <= 4096
    monkeypatch.setenv("TRAINGUARD_TABLE_UP_TO", "0")
    assert Agreement(0, 2, torch.device("cpu")).way == "summary"


def test_a_healthy_step_at_65536_ranks_meets_the_goals_and_builds_nothing_per_rank(tmp_path, monkeypatch):
    """bench/scale.py's step at 65,536 simulated ranks (its goals, checked there: healthy <= 2 ms of host time -- median;
    measured ~0.5 ms here --, the non-finite rank named with its coordinates, samples and module <= 50 ms; bounded
    here with a margin for a busy machine), <= 4 KB reduced per rank; and no
    per-rank observation is built on a healthy step (the structural reason the time does not grow)."""
    import trainguard.step.agreement as agreement

    built = []
    real = agreement.observations

    def counting(rows, *a, **kw):
        built.append(len(rows))
        return real(rows, *a, **kw)

    monkeypatch.setattr(agreement, "observations", counting)
    torch.set_num_threads(1)
    out = scale.run(65536, "summary", 20, tmp_path)
    assert out["bytes"] <= scale.GOALS["bytes"]
    # the time goals are bench/scale.py's (measured in a quiet run); here ten times their margin, for a busy machine
    # (a busy CI measured 65 ms on the anomalous step once) -- what still fails is a step that grew with the world
    assert out["healthy_ms"] <= 10 * scale.GOALS["healthy_ms"], out
    assert out["anomalous_ms"] <= 10 * scale.GOALS["anomalous_ms"], out
    # one row (this rank's own) per healthy step; on the anomalous step that and the non-finite rank's
    assert built == [1] * (20 + 2), built


@pytest.mark.parametrize("world", [8, 100])
def test_the_simulated_world_names_the_same_rank_either_way(tmp_path, world):
    """The table way (what every world ran before) and the summary way name the same rank, samples and module."""
    for way in ("table", "summary"):
        scale.run(world, way, 8, tmp_path)  # (raises when the rank is not named as it should be)


def test_above_64_ranks_the_straggler_is_the_slowest_rank_against_the_mean():
    """The reduced view (detectors.straggler above 64 ranks): a rank the slowest by 2x for most of its window is
    named once, with since when; the healthy steps before it name nobody, and noise that moves the slowest rank
    from step to step names nobody either."""
    from trainguard.config import StragglerConfig
    from trainguard.detectors.straggler import StragglerDetector
    from trainguard.ranks.reduced import Extreme

    det = StragglerDetector(StragglerConfig(window=10))
    rng = random.Random(1)

    def step(s, slow_rank, slow_s):
        summary = Summary.of_rows([])  # (an empty world: then the fields below)
        summary = summary.__class__(**{**summary.__dict__, "world": 1000, "compute_mean": 0.1,
                                       "compute_max": Extreme(slow_s, slow_rank)})
        return det.observe_reduced(s, summary)

    found = [v for s in range(1, 200) for v in step(s, rng.randrange(1000), 0.1 * rng.uniform(1.05, 1.4))]
    assert found == []  # (a different rank is the slowest each step: nobody is slow for long)
    found = [(s, v) for s in range(200, 230) for v in step(s, 417, 0.2)]
    assert len(found) == 1
    s, v = found[0]
    assert v.ranks == (417,) and v.detail["slower_by"] == 2.0 and s <= 200 + 10 and v.detail["since_step"] >= 200 - 10


def test_a_sampled_check_has_every_ranks_row_on_its_steps_only(tmp_path, monkeypatch):
    """The replica check above 64 ranks: every rank's digest travels on its check steps (the rows are gathered), on
    no other step; a registered detector with a column but no ``sampled`` has the rows every step."""
    from trainguard.config import parse_block
    from trainguard.step.guard import StepGuard

    monkeypatch.setenv("TRAINGUARD_TABLE_UP_TO", "0")  # (one rank, on the summary way)
    cfg = parse_block({"metrics": {"jsonl": str(tmp_path / "tg.jsonl")}, "checks": {"enabled": False},
                       "detectors": {"replica_check": {"enabled": True, "every_steps": 5}}})
    guard = StepGuard(cfg, 0, 1)
    guard.attach_model(torch.nn.Linear(3, 3))
    assert guard.agreement.way == "summary" and guard.detectors.rows_every_step == []
    full = {}
    for step in range(1, 11):
        guard.on_loss(step, torch.tensor(1.0))
        view = guard.on_agree(step)
        full[step] = view.full
        guard.on_decide(step, view)
        guard.on_end(step, view, {"grad_norm": None})
    assert [s for s, f in full.items() if f] == [5, 10]
    from trainguard.detectors.replica import ReplicaCheck

    monkeypatch.delattr(ReplicaCheck, "sampled")
    assert StepGuard(cfg, 0, 1).detectors.rows_every_step == ["replica_check"]


def test_above_64_ranks_prometheus_gets_the_oldest_heartbeat_and_the_followed_stragglers():
    """The alert rules' series from a summary-way line: the oldest clock as rank "oldest"'s heartbeat, the slowest
    time, and the straggler ratio of the ranks the detector follows -- a rank it stops following leaves the gauge."""
    imported("prometheus_client")
    from trainguard.metrics.prometheus import PrometheusSink

    sink = PrometheusSink(port=0, addr="127.0.0.1")
    try:
        sink.metric(5, {"loss": 1.0, "clock_min": [1000.5, 17], "compute_s_max": [0.3, 4],
                        "straggler_ratio_by_rank": {"4": 1.9}})
        get = sink.registry.get_sample_value
        assert get("trainguard_heartbeat_timestamp_seconds", {"rank": "oldest"}) == 1000.5
        assert get("trainguard_step_compute_seconds", {"rank": "max"}) == 0.3
        assert get("trainguard_straggler_ratio", {"rank": "4"}) == 1.9
        sink.metric(6, {"loss": 1.0, "clock_min": [1001.5, 3], "compute_s_max": [0.1, 9], "straggler_ratio_by_rank": {}})
        assert get("trainguard_heartbeat_timestamp_seconds", {"rank": "oldest"}) == 1001.5
        assert get("trainguard_straggler_ratio", {"rank": "4"}) is None
    finally:
        sink.close()
