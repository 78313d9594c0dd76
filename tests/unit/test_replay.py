"""trainguard.replay.replay: data or weights, and which sample -- the pure verdicts over replayed losses."""
import math

from trainguard.replay.replay import MicroBatch, ReplayBook, culprit_rows, judge_loss, narrow, weights_verdict
from trainguard.detectors.stats import RollingWindow


def healthy_below(limit):
    return lambda x: math.isfinite(x) and x < limit


def test_weights_verdict_from_every_ranks_replay():
    ok = healthy_below(3.0)
    assert weights_verdict([1.0, 1.2], ok) == "healthy"
    assert weights_verdict([1.0, float("nan")], ok) == "damaged"   # one rank's weights are enough
    assert weights_verdict([5.0, 5.2], ok) == "damaged"            # a spike on the old, healthy batch
    assert weights_verdict([1.0, None], ok) is None                # a rank had nothing to replay
    assert weights_verdict([], ok) is None


def test_culprit_rows_are_the_fewest_whose_removal_heals_the_batch():
    ok = healthy_below(3.0)
    assert culprit_rows([1.0, float("nan"), 1.1, 0.9], ok) == [1]
    assert culprit_rows([1.0, 40.0, 1.1, 0.9, 1.0, 1.2, 1.0, 1.1], ok) == [1]
    assert culprit_rows([1.0, 40.0, 1.1, 30.0, 1.0, 1.2, 1.0, 1.1], ok) == [1, 3]
    assert culprit_rows([1.0, 1.1, 0.9, 1.0], ok) is None                        # nothing to blame
    assert culprit_rows([float("nan")] * 4, ok) is None                           # the whole batch
    assert culprit_rows([9.0, 9.0, 9.0, 1.0], ok) is None                         # more than half
    assert culprit_rows([1.0, None, 1.0], ok) is None                             # a row not replayed


def test_judge_uses_the_spike_detectors_robust_z():
    w = RollingWindow(50)
    for i in range(30):
        w.push(1.0 + 0.01 * (i % 5))
    assert judge_loss(1.02, w.robust_z, 6.0) and not judge_loss(2.0, w.robust_z, 6.0)
    assert not judge_loss(float("inf"), None, 6.0) and judge_loss(100.0, None, 6.0)


def test_narrow_maps_rows_to_sample_ids_across_micro_batches_and_the_book_keeps_the_last_healthy_one():
    a = MicroBatch("a", ids=[10, 11, 12, 13], rows=4)
    b = MicroBatch("b", ids=[14, 15, 16, 17], rows=4)
    losses = {("a", r): 1.0 for r in range(4)} | {("b", r): 1.0 for r in range(4)}
    losses[("b", 2)] = float("nan")
    losses[("a", None)], losses[("b", None)] = 1.0, float("nan")
    out = narrow([a, b], lambda mb, r: losses[(mb.inputs, r)], healthy_below(3.0))
    assert out["ids"] == [16] and out["rows"] == 4 and out["losses"] == {"16": "nan"}  # (a replayed healthy)
    # ids unknown or not one per row: no narrowing (the whole batch is named)
    assert narrow([MicroBatch("a", ids=[], rows=4)], lambda mb, r: 1.0, healthy_below(3.0)) is None
    book = ReplayBook()
    book.record(a)
    book.record(b)
    book.step_ended(healthy=True)
    assert book.healthy is b and book.step == []
    book.record(MicroBatch("c", ids=[1], rows=1))
    book.step_ended(healthy=False)  # an anomaly step is never the probe
    assert book.healthy is b


def test_narrow_searches_only_the_micro_batches_that_replay_badly_and_caps_its_replays():
    calls = []

    def run(mb, row):
        calls.append((mb.inputs, row))
        return float("nan") if (mb.inputs, row) in (("b", None), ("b", 1)) else 1.0

    mbs = [MicroBatch(name, ids=[10 * i + r for r in range(4)], rows=4) for i, name in enumerate("abc")]
    out = narrow(mbs, run, healthy_below(3.0))
    assert out["ids"] == [11] and out["rows"] == 4
    assert calls == [("a", None), ("b", None), ("c", None)] + [("b", r) for r in range(4)]
    assert narrow(mbs, run, healthy_below(3.0), max_rows=3) is None
