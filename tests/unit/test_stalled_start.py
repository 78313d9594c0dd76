"""A stalled start (issue 51's held-out misses: a warmup of one step to a peak LR 5-25x too high): the loss never
climbs from a best, it never leaves its first level while the gradient norm collapses. Seen once, as a slow_rise from
the LR's peak -- a young run's restart with a tenth of that LR --; and never on a fine-tune that starts near its
floor, a run that learns slowly at a small LR, a healthy run, or a history that begins mid-run."""
import math

import pytest
import torch

from trainguard.config import LossTrendConfig
from trainguard.detectors.loss_trend import LossTrendDetector
from trainguard.recovery.lrcut import LrHistory


def run(steps, loss_at, grad_at, lr_at, seed=0, first_step=1, trend=None):
    """Feed a detector: the verdicts and the steps they came at."""
    g = torch.Generator().manual_seed(seed)
    trend = trend or LossTrendDetector(LossTrendConfig())
    out = []
    for s in range(first_step, first_step + steps):
        noise = math.exp(0.05 * float(torch.randn(1, generator=g)))
        v = trend.observe(s, loss_at(s) * noise, lr=lr_at(s), grad=grad_at(s) * noise)
        if v is not None:
            out.append((s, v))
    return out, trend


def warmup(n, peak):
    return lambda s: peak * min(1.0, (s - 1) / n) if n else peak


def test_a_run_that_learns_nothing_at_its_peak_lr_is_a_young_slow_rise_from_the_peak():
    # the dev seed s4 (128x4, bf16, LR 0.03 in one step): loss 4.85 -> ~4.4 for good, gradient norm 2.7 -> 0.16
    found, trend = run(300, lambda s: 4.85 - 0.45 * min(1.0, s / 40), lambda s: 2.7 / (1 + 16 * min(1.0, s / 40)),
                       warmup(1, 0.03))
    assert len(found) == 1, found
    step, v = found[0]
    assert v.anomaly == "slow_rise" and v.detail["stall"] and v.ranks == ()  # (shared: no rank named)
    assert v.detail["onset_step"] == 2 and step == 2 + trend.cfg.settle
    # the LR history makes it a young run's cut: a tenth of the peak, from the first step's checkpoint
    lrs = LrHistory(settle=trend.cfg.settle)
    for s in range(1, step + 1):
        lrs.agree(warmup(1, 0.03)(s))
        lrs.ratio(s, 1)
    scale, why, restart = lrs.cut(v.detail["onset_step"], step, 0.5)
    assert restart and scale == pytest.approx(0.1) and "young" in why


@pytest.mark.parametrize("name,loss_at,grad_at,lr_at", [
    # a fine-tune starting near its floor: its loss falls a few percent, its gradient norm holds
    ("fine-tune, no warmup", lambda s: 1.9 - 0.1 * min(1.0, s / 200), lambda s: 1.1, warmup(0, 2e-5)),
    # ... even one whose gradient norm halves as it adapts
    ("fine-tune, norm halves", lambda s: 2.3 - 0.3 * min(1.0, s / 100), lambda s: 3.0 / (1 + min(1.0, s / 50)),
     warmup(10, 5e-5)),
    # a run that learns slowly at a small LR: the loss barely moves, nor does the model
    ("slow learner", lambda s: 4.85 - 0.3 * s / 600, lambda s: 2.7, warmup(100, 1e-5)),
    # a healthy run from scratch: the gradient norm falls 4x -- with the loss
    ("healthy from scratch", lambda s: 1.0 + 3.85 * math.exp(-s / 15), lambda s: 0.65 + 2.1 * math.exp(-s / 20),
     warmup(100, 0.003)),
])
def test_no_stall_where_the_run_learns_or_the_model_holds(name, loss_at, grad_at, lr_at):
    found, _ = run(1500, loss_at, grad_at, lr_at)
    assert not found, (name, found[:2])


def test_a_history_that_begins_mid_run_has_no_first_level_to_stall_at():
    # a resume at step 5,000 without the guard's state, of a run whose norm then falls: no stall judged
    found, _ = run(600, lambda s: 2.0, lambda s: 4.0 / (1 + 8 * min(1.0, (s - 5000) / 100)), warmup(0, 1e-3),
                   first_step=5000)
    assert not found
    # and a guard state from before the rule (no first_step): none either
    trend = LossTrendDetector(LossTrendConfig())
    trend.load_state_dict({"best": 4.8, "best_step": 100, "first": 4.8, "seen": 100})
    found, _ = run(300, lambda s: 4.8, lambda s: 2.7 / (1 + 16 * min(1.0, (s - 101) / 40)), warmup(0, 0.03),
                   first_step=101, trend=trend)
    assert not found


def test_the_stall_is_off_at_zero_and_said_once():
    found, _ = run(300, lambda s: 4.8, lambda s: 2.7 / (1 + 16 * min(1.0, s / 40)), warmup(1, 0.03),
                   trend=LossTrendDetector(LossTrendConfig(stall_fall=0)))
    assert not found
    found, trend = run(600, lambda s: 4.8, lambda s: 2.7 / (1 + 16 * min(1.0, s / 40)), warmup(1, 0.03))
    assert len(found) == 1
    again = LossTrendDetector(LossTrendConfig())
    again.load_state_dict(trend.state_dict())
    assert again.stalled and again.first_step == 1


def test_a_first_level_the_lr_jump_lifted_is_no_escape():
    # dev seed s21 (LR 0.075 in one step): the loss jumps 4.9 -> 9 in the first steps, then stalls at ~4.4 -- 24% below
    # the first smoothed level, 10% below where the run began (its first three losses, before the LR acted)
    loss = lambda s: 4.88 if s <= 3 else 9.0 if s < 10 else 4.4
    found, _ = run(200, loss, lambda s: 2.8 / (1 + 8 * min(1.0, s / 30)), warmup(1, 0.075))
    assert len(found) == 1 and found[0][1].detail["first_level"] < 6  # (not the lifted ~9)


def test_no_stall_after_a_long_warmup_or_from_one_easy_first_batch_or_after_a_rollback():
    # a fine-tune (SFT) warmed up over 1,000 steps: its loss falls 15%, its gradient norm 5x as it adapts to the format
    found, _ = run(1300, lambda s: 2.0 - 0.3 * min(1.0, s / 400), lambda s: 8.0 / (1 + 4 * min(1.0, s / 300)),
                   warmup(1000, 2e-5))
    assert not found
    # one unusually easy first batch (short sequences: 1.0) does not set where the run began (it learns: 2.5 -> 1.5)
    found, _ = run(200, lambda s: 1.0 if s == 1 else 2.5 - 1.0 * min(1.0, s / 40), lambda s: 2.7 / (1 + 8 * min(1.0, s / 30)),
                   warmup(1, 1e-3))
    assert not found
    # after a rollback (a young climb's restart) the first trajectory's peak and gradient levels are not judged again
    trend = LossTrendDetector(LossTrendConfig())
    run(40, lambda s: 4.8, lambda s: 2.7 / (1 + 16 * min(1.0, s / 20)), warmup(1, 0.03), trend=trend)
    trend.rolled_back(1)
    found, _ = run(200, lambda s: 4.8, lambda s: 0.1, warmup(1, 0.003), first_step=2, trend=trend)
    assert not found

