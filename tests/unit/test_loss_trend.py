"""The loss seen against its own recent best, and repeated surges as a rise (issue 33)."""
import math

import torch

from trainguard.config import GradNormConfig, LossTrendConfig
from trainguard.detectors.grad_norm import GradNormDetector
from trainguard.detectors.loss_trend import LossTrendDetector, classify


def noisy(values, amp, seed):
    g = torch.Generator().manual_seed(seed)
    return [v * (1 + amp * float(torch.randn(1, generator=g))) for v in values]


def megatron_lr_blowup():
    """The shape filed from Megatron-LM's pretrain_gpt.py at too high a peak LR: the loss falls to ~2.4 by
    step 60, then climbs for 30 iterations to ~7.0 -- one step at a time, each only a little above the last."""
    fall = [10.0 - (10.0 - 2.4) * (1 - math.exp(-i / 15)) for i in range(60)]
    climb = [2.4 * (7.0 / 2.4) ** (i / 30) for i in range(1, 31)]
    return noisy(fall + climb + [7.0] * 20, 0.04, seed=7)


def test_a_climb_one_step_at_a_time_is_seen_within_ten_steps_of_leaving_its_band():
    losses = megatron_lr_blowup()
    lrs = [min(1.0, (i + 1) / 80) * 3e-3 for i in range(len(losses))]  # a linear warmup to too high a peak
    det = LossTrendDetector(LossTrendConfig())
    found = [(s, det.observe(s, x, lr=lrs[s - 1])) for s, x in enumerate(losses, 1)]
    found = [(s, v) for s, v in found if v]
    assert len(found) == 1, found  # one verdict per episode
    step, v = found[0]
    left_band = next(s for s in range(61, 111) if losses[s - 1] > 2.4 * 1.2)  # the raw loss leaves +20%
    assert 0 <= step - left_band <= 10, (step, left_band)
    assert v.anomaly == "slow_rise" and v.detail["onset_step"] <= 62 and "LR rose" in v.detail["evidence"][0]
    # the spike detector's window, fed the same losses, absorbs the climb (what was filed)
    from trainguard.config import LossSpikeConfig
    from trainguard.detectors.loss_spike import LossSpikeDetector

    spike = LossSpikeDetector(LossSpikeConfig())
    assert not [s for s, x in enumerate(losses[:90], 1) if spike.observe(s, x, None, 0.0)]


def test_a_healthy_noisy_run_raises_nothing_in_two_thousand_steps():
    base = [1.4 + 3.4 * math.exp(-i / 60) for i in range(2000)]
    for seed in range(3):
        det = LossTrendDetector(LossTrendConfig())
        assert not [s for s, x in enumerate(noisy(base, 0.08, seed), 1) if det.observe(s, x, lr=1e-3)]


def test_the_class_comes_from_loss_gradient_and_lr_together():
    assert classify(1.5, None, jumped=True)[0] == "slow_rise"        # the LR rose: too high a peak
    assert classify(1.0, 3.0, jumped=True)[0] == "slow_rise"         # the gradient norm stands high
    assert classify(1.0, 1.0, jumped=True)[0] == "instant_burst"     # a jump with LR and gradient calm: data
    assert classify(1.0, 1.0, jumped=False)[0] == "slow_rise"        # a gradual climb
    # a stretch of garbage data: the loss jumps and stays up, LR flat, gradient calm
    det = LossTrendDetector(LossTrendConfig())
    losses = noisy([2.0] * 60, 0.03, seed=1) + noisy([4.0] * 20, 0.03, seed=2)
    found = [v for s, x in enumerate(losses, 1) if (v := det.observe(s, x, lr=1e-3, grad_ratio=1.1))]
    assert [v.anomaly for v in found] == ["instant_burst"]


def test_rollback_voids_the_climb_but_keeps_the_best():
    det = LossTrendDetector(LossTrendConfig())
    for s, x in enumerate(megatron_lr_blowup()[:75], 1):
        det.observe(s, x)
    best = det.best
    state = det.state_dict()
    det.rolled_back()
    assert det.best == best and len(det.raw) == 0
    det2 = LossTrendDetector(LossTrendConfig())
    det2.load_state_dict(state)
    assert det2.best == best and det2.best_step == det.best_step


def test_repeated_gradient_surges_are_a_slow_rise():
    """Megatron-LM's norm at too high an LR: surges of z 7.9, 13, 42, 28 with calm steps between -- no clean
    log-slope over 12 steps, so no slow_rise was ever given. Three surges within 50 steps are one."""
    det = GradNormDetector(GradNormConfig())
    norms = noisy([1.0] * 60, 0.1, seed=3)
    for k, z in ((30, 8.0), (36, 13.0), (41, 40.0), (47, 28.0)):
        norms[k] = 1.0 + z * 0.15
    kinds = [(s, [v.anomaly for v in det.observe(s, n)]) for s, n in enumerate(norms, 1)]
    rises = [s for s, k in kinds if "slow_rise" in k]
    assert rises == [42], kinds[28:50]
    assert det.onset(42) <= 31
    # surges that go on after the remedy (the driver resets the trend after a rollback or an LR lowered in place)
    # are a new episode: counted afresh, a second slow_rise
    det.reset_trend()
    more = noisy([1.0] * 40, 0.1, seed=9)
    for k in (5, 12, 20):
        more[k] = 1.0 + 20 * 0.15
    again = [s for s, n in enumerate(more, 61) if any(v.anomaly == "slow_rise" for v in det.observe(s, n))]
    assert again == [81]
    healthy = GradNormDetector(GradNormConfig())
    assert not [s for s, n in enumerate(noisy([1.0] * 500, 0.1, seed=4), 1)
                if any(v.anomaly == "slow_rise" for v in healthy.observe(s, n))]
