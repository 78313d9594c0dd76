"""Thresholds that know the loss's own noise and how far it has come, and a "young" run measured by its own
schedule (issue 51): the shapes of the healthy runs a relative rule acted on, and the failures it must still see."""
import math

import pytest
import torch

from trainguard.config import LossSpikeConfig, LossTrendConfig
from trainguard.detectors.loss_spike import LossSpikeDetector
from trainguard.detectors.loss_trend import LossTrendDetector
from trainguard.recovery.lrcut import LrHistory


def near_zero_run(steps: int, floor: float, seed: int, wiggle: float = 0.35, hard_every: int = 0):
    """A healthy run that trains down to a loss near 0 (Megatron-LM's tiny GPT on mock data at a good LR): from the
    first level 10.8 down to ``floor`` by step ~90, then wiggling by ``wiggle`` (log-normal, a loss near its floor
    moves by a third of itself step to step), slowly drifting; every ``hard_every`` steps one hard sample lifts the
    step's loss to 0.42 whatever the floor (what was filed: 0.418 against a median of 0.0125)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(steps):
        level = floor + (10.8 - floor) * math.exp(-i / 12)
        level *= 1 + 0.3 * math.sin(i / 97)  # (a slow drift of the floor: +-30% over ~600 steps)
        x = level * math.exp(wiggle * float(torch.randn(1, generator=g)))
        if hard_every and i > 150 and i % hard_every == 0:
            x = 0.42
        out.append(x)
    return out


@pytest.mark.parametrize("floor,seed", [(0.014, 1), (0.005, 2), (0.0125, 3), (0.05, 4)])
def test_a_healthy_run_near_a_loss_of_zero_raises_nothing_in_1500_steps(floor, seed):
    # (the Megatron-LM runs that were restarted from step 1 -- 0.014 -> 0.0186 read as a 33% "slow_rise" -- and
    # rolled back -- 0.0037 -> 0.0088 --, and the one skipped twelve times for single hard samples)
    losses = near_zero_run(1500, floor, seed, hard_every=9)
    trend, spike = LossTrendDetector(LossTrendConfig()), LossSpikeDetector(LossSpikeConfig())
    verdicts = [v for s, x in enumerate(losses, 1) for v in (trend.observe(s, x, lr=0.01), spike.observe(s, x, None, 0.0))
                if v is not None]
    assert not verdicts, verdicts[:3]
    # (what the old rule saw: the relative band alone is crossed by the wiggle)
    old = LossTrendDetector(LossTrendConfig(noise_z=0, min_regain=0))
    assert [v for s, x in enumerate(losses, 1) if (v := old.observe(s, x, lr=0.01))]


def test_a_divergence_near_the_floor_is_still_seen_and_a_random_batch_is_still_a_burst():
    losses = near_zero_run(400, 0.02, seed=5, wiggle=0.2)
    # a late divergence: from ~0.02 the loss climbs back to 4 over 40 steps (it gives back what it learnt)
    g = torch.Generator().manual_seed(8)
    climb = [0.02 * (4 / 0.02) ** (i / 40) * math.exp(0.2 * float(torch.randn(1, generator=g))) for i in range(1, 61)]
    trend = LossTrendDetector(LossTrendConfig())
    found = [(s, v) for s, x in enumerate(losses + climb, 1) if (v := trend.observe(s, x, lr=0.01))]
    assert len(found) == 1 and 400 < found[0][0] <= 440, found
    assert found[0][1].detail["band"] > found[0][1].detail["best"] and found[0][1].detail["first_level"] > 5
    # one batch of another tokenizer's ids scores near the first level: a burst, whatever the floor
    spike = LossSpikeDetector(LossSpikeConfig())
    for s, x in enumerate(losses, 1):
        spike.observe(s, x, None, 0.0)
    v = spike.observe(401, 9.5, None, 0.0)
    assert v is not None and v.anomaly == "instant_burst"


def test_the_spike_and_trend_floors_ride_the_guards_state():
    losses = near_zero_run(200, 0.01, seed=6)
    trend, spike = LossTrendDetector(LossTrendConfig()), LossSpikeDetector(LossSpikeConfig())
    for s, x in enumerate(losses, 1):
        trend.observe(s, x)
        spike.observe(s, x, None, 0.0)
    t2, s2 = LossTrendDetector(LossTrendConfig()), LossSpikeDetector(LossSpikeConfig())
    t2.load_state_dict(trend.state_dict())
    s2.load_state_dict(spike.state_dict())
    assert t2.first == trend.first > 5 and t2.spread == trend.spread > 0 and s2.first == spike.first > 5
    t2.rolled_back(150)
    assert t2.spread == trend.spread and t2.first == trend.first


def ramp(warmup: int, until: int, peak: float = 0.03, start: int = 1) -> LrHistory:
    h = LrHistory()
    for s in range(start, until + 1):
        h.record(s, peak * min(s, warmup) / warmup)
    return h


def test_young_is_measured_against_the_runs_own_warmup_not_a_step_count():
    # twice the warmup: a climb at 900 in a warmup of 500 steps is young (a tenth, from the first step) ...
    h = ramp(500, 950)
    scale, why, restart = h.cut(onset=900, now=950, configured=0.5)
    assert restart and scale == pytest.approx(0.1 * 0.03 / 0.03) and "young run" in why and "step 1000" in why
    # ... a climb at 250 after a warmup of 100 is not (the configured factor, no restart)
    assert ramp(100, 300).cut(onset=250, now=300, configured=0.5) == (0.5, "", False)
    # no warmup: twice the steps the loss trend takes to speak (min_history + 4 x smooth + patience = 54)
    h = ramp(1, 200)
    assert h.horizon() == 2 * h.settle == 108
    assert h.young(100) and not h.young(150)
    # a history that begins mid-run (a resume without the guard's state) is not young
    assert not ramp(100, 700, start=600).young(650)
    # the first rise rides the guard's state; a state from before it says nothing young
    h2 = LrHistory()
    h2.load_state_dict(ramp(500, 950).state_dict())
    assert h2.young(900) and h2.ramp_end == h2.last_rise == 500
    h3 = LrHistory()
    h3.load_state_dict({"steps": [[s, 0.03] for s in range(900, 950)]})
    assert not h3.young(920)


def test_the_detectors_settling_time_follows_their_config():
    h = LrHistory.for_trend(LossTrendConfig(min_history=100, smooth=20, patience=5))
    assert h.settle == 185


def test_a_long_or_logarithmic_warmup_is_one_rise_to_its_end():
    # (from a review: a rise counted against the step before ended a linear warmup of 4,000 steps at ~1,000 -- its
    # step-to-step increase falls below 0.1% -- and DeepSpeed's log warmup at ~190)
    h = ramp(4000, 4100)
    assert h.ramp_end == h.last_rise == 4000 and h.young(7900) and not h.young(8100)
    import math as m
    log = LrHistory()
    for s in range(1, 2100):
        log.record(s, 0.01 * min(1.0, m.log(s + 1) / m.log(2000)))
    assert log.last_rise >= 1990 and log.young(3900)
