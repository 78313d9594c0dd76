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
    found = [v for s, x in enumerate(losses, 1) if (v := det.observe(s, x, lr=1e-3, grad_ratio=lambda since: 1.1))]
    assert [v.anomaly for v in found] == ["instant_burst"]


def test_rollback_voids_the_climb_but_keeps_the_best():
    det = LossTrendDetector(LossTrendConfig())
    for s, x in enumerate(megatron_lr_blowup()[:75], 1):
        det.observe(s, x)
    best = det.best
    state = det.state_dict()
    det.rolled_back()
    assert det.best == best and len(det.raw) == 0
    # back to step 45 (loss ~2.9 then): its best then, not the later 2.4 -- else its own loss looks like a climb
    det.rolled_back(45)
    assert det.best > best and det.best_step <= 45
    fall = megatron_lr_blowup()
    assert not [s for s, x in enumerate(fall[45:60], 46) if det.observe(s, x)]
    det2 = LossTrendDetector(LossTrendConfig())
    det2.load_state_dict(state)
    assert det2.best == best and det2.best_step == state["best_step"]
    det2.rolled_back(75)  # (back to the checkpoint it resumed from: the best it restored stays)
    assert det2.best == best


def test_repeated_gradient_surges_are_a_slow_rise():
    """Megatron-LM's norm at too high an LR: surges of z 7.9, 13, 42, 28 with calm steps between -- no clean
    log-slope over 12 steps, so no slow_rise was ever given. Three surges within 50 steps are one."""
    det = GradNormDetector(GradNormConfig())
    norms = noisy([1.0] * 60, 0.1, seed=3)
    for k, z in ((30, 8.0), (36, 13.0), (41, 40.0), (47, 28.0)):
        norms[k] = 1.0 + z * 0.15
    found = [(s, det.observe(s, n)) for s, n in enumerate(norms, 1)]
    kinds = [(s, [v.anomaly for v in vs]) for s, vs in found]
    rises = [s for s, k in kinds if "slow_rise" in k]
    assert rises == [42], kinds[28:50]
    (rise,) = [v for v in found[41][1] if v.anomaly == "slow_rise"]
    assert rise.detail["onset_step"] == 31 and rise.detail["surges"] == [31, 37, 42]
    # surges that go on after the remedy (the driver resets the trend after a rollback or an LR lowered in place)
    # are a new episode: counted afresh, a second slow_rise
    det.reset_trend()
    more = noisy([1.0] * 40, 0.1, seed=9)
    for k in (5, 12, 20):
        more[k] = 1.0 + 20 * 0.15
    again = [s for s, n in enumerate(more, 61) if any(v.anomaly == "slow_rise" for v in det.observe(s, n))]
    assert again == [81]
    # a loss that goes on improving: surges alone are no rise (a heavy-tailed norm)
    learning = GradNormDetector(GradNormConfig())
    assert not [s for s, n in enumerate(norms, 1)
                if any(v.anomaly == "slow_rise" for v in learning.observe(s, n, loss_up=False))]
    healthy = GradNormDetector(GradNormConfig())
    assert not [s for s, n in enumerate(noisy([1.0] * 500, 0.1, seed=4), 1)
                if any(v.anomaly == "slow_rise" for v in healthy.observe(s, n))]


def test_a_bad_batchs_surge_does_not_count_toward_a_rise():
    """A stretch of bad data: each bad batch's gradient surges with its loss burst. Those surges are the data's,
    not the LR's; counted, three of them lowered the LR until lr_floor aborted the run (bench/natural)."""
    det = GradNormDetector(GradNormConfig())
    for s, n in enumerate(noisy([1.0] * 40, 0.1, seed=5), 1):
        det.observe(s, n)
    for s in (41, 42):
        assert [v.anomaly for v in det.observe(s, 5.0)] == ["grad_surge"]
        assert det.blame_data(s) is False
    found = [v.anomaly for v in det.observe(43, 5.0)]
    assert found == ["grad_surge"]  # two surges left the count: no rise
    det2 = GradNormDetector(GradNormConfig())
    for s, n in enumerate(noisy([1.0] * 40, 0.1, seed=5), 1):
        det2.observe(s, n)
    for s in (41, 42):
        det2.observe(s, 5.0)
    assert "slow_rise" in [v.anomaly for v in det2.observe(43, 5.0)]
    assert det2.blame_data(43) is True and not det2.in_rise  # the rise completed by a bad batch is void


def test_a_spike_right_after_the_lr_jumped_is_the_lrs_not_a_batchs():
    """A run resumed with its schedule raised 15x: the loss spikes at once, with no creep of the gradient norm
    before it. Classified instant_burst, each spike was skipped as bad data (bench/natural lr_raised_midrun); the
    LR's jump within the last 10 steps makes it slow_rise."""
    from trainguard.config import LossSpikeConfig
    from trainguard.detectors.loss_spike import LossSpikeDetector

    det = LossSpikeDetector(LossSpikeConfig())
    for s, x in enumerate(noisy([2.0] * 40, 0.02, seed=2), 1):
        det.observe(s, x, None, 0.0)
    assert det.observe(41, 8.0, None, 30.0, lr_ratio=1.0).anomaly == "instant_burst"
    v = det.observe(42, 8.0, None, 30.0, lr_ratio=15.0)
    assert v.anomaly == "slow_rise" and "LR rose x15.00" in v.detail["why"]


def test_a_gradient_norm_rising_in_a_warmup_whose_loss_falls_is_no_creep_before_the_trend_knows_a_best():
    """A held-out draw's healthy run (s5017: no final LayerNorm before the output head, the healthy LR after a warmup
    of 100 steps) raised its gradient norm 45x in its first 22 steps while its loss fell from 4.85 to 3.94; the loss
    trend, which needs 32 steps for a level, counted as "up" for want of evidence, and the norm's creep restarted the
    healthy run with a fourteenth of its LR for good. Before the trend knows a best, "up" is the smoothed loss above the
    lowest it has been: the falling loss keeps the creep quiet, and the same draw at 20x its LR -- the loss climbing
    from 4.85 to 36 while the norm rises -- is still a creep, as early as before (step 24)."""
    from trainguard.config import parse_block
    from trainguard.detectors.grad_norm import GradNormDetector

    healthy = ([4.853, 4.853, 4.852, 4.849, 4.844, 4.835, 4.827, 4.819, 4.798, 4.775, 4.74, 4.704, 4.626, 4.549, 4.472,
                4.414, 4.37, 4.202, 4.288, 4.097, 3.942, 3.97],
               [0.152, 0.097, 0.093, 0.092, 0.088, 0.099, 0.119, 0.121, 0.179, 0.218, 0.304, 0.383, 0.557, 0.691, 0.674,
                0.938, 1.469, 1.194, 4.252, 2.257, 1.803, 3.857])  # (the ranks' local norms' RMS: what the detector reads)
    failing = ([4.853, 4.853, 4.852, 4.814, 4.639, 5.019, 7.775, 7.376, 13.713, 7.406, 8.565, 9.224, 13.489, 12.07,
                14.864, 18.534, 20.576, 19.669, 24.668, 33.992, 33.355, 35.226, 35.97, 27.559],
               [0.152, 0.097, 0.093, 0.233, 0.752, 7.158, 17.233, 22.845, 17.175, 28.815, 25.832, 24.241, 40.011, 37.849,
                40.325, 64.825, 71.765, 46.418, 59.337, 94.25, 83.055, 99.072, 88.373, 54.052])
    cfg = parse_block({}).detectors

    def creeps(losses, norms):
        trend, grad, found = LossTrendDetector(cfg.loss_trend), GradNormDetector(cfg.grad_norm), []
        for step, (loss, norm) in enumerate(zip(losses, norms), 1):  # (the order trainguard.detectors.spikes runs them)
            found += [step for v in grad.observe(step, norm, [0], loss_up=trend.standing_above(0.05))
                      if v.anomaly == "slow_rise"]
            trend.observe(step, loss, 0.001, grad=norm)
        return found, trend
    quiet, trend = creeps(*healthy)
    assert quiet == [] and trend.best is None  # (before a best: the case the rule is for)
    loud, _ = creeps(*failing)
    assert loud and loud[0] <= 24, loud


def test_a_loss_that_climbs_from_where_it_began_before_the_trend_can_speak_names_where_it_stopped_falling():
    """What the LR range test reads in a young run's bf16 start-over (trainguard.step.judgement): a held-out draw (s5020,
    one wide head at 50x in fp16) climbed from 4.66 to 8.17 in its first steps as its LR rose, and overflowed fp16 at
    22 -- 32 steps before the trend has a level. The step its loss stopped falling is named (the bottom, where the
    climb began); the healthy draw whose loss fell all the way (s5017) names none, nor does a climb after the trend has
    its best (the band's), nor one after ``before``; a rollback forgets it, a checkpoint keeps it."""
    s5020 = [4.88, 4.87, 4.66, 5.12, 6.44, 6.67, 8.17, 7.0, 6.15, 7.02, 6.86, 6.24, 5.91, 5.36, 4.99, 4.7, 4.77, 4.7,
             4.92, 4.97, 4.93]
    cfg = LossTrendConfig()
    trend = LossTrendDetector(cfg)
    for step, loss in enumerate(s5020, 2):  # (its steps after a restart from the first step: 2, 3, ...)
        trend.observe(step, loss, 0.01 * step)
    bottom = trend.early_climb(22)
    assert bottom is not None and 2 <= bottom <= 5 and trend.best is None
    assert trend.early_climb(9) is None  # (the climb was seen later than that)
    import json

    again = LossTrendDetector(cfg)
    again.load_state_dict(json.loads(json.dumps(trend.state_dict())))  # (as the guard's state travels)
    assert again.early_climb(22) == bottom
    again.rolled_back(20)  # (a rollback that keeps the steps of the climb keeps it: a non-finite step's, after it)
    assert again.early_climb(22) == bottom
    trend.rolled_back(1)
    assert trend.early_climb(22) is None
    healthy = [4.853, 4.853, 4.852, 4.849, 4.844, 4.835, 4.827, 4.819, 4.798, 4.775, 4.74, 4.704, 4.626, 4.549, 4.472,
               4.414, 4.37, 4.202, 4.288, 4.097, 3.942, 3.97]
    quiet = LossTrendDetector(cfg)
    for step, loss in enumerate(healthy, 1):
        quiet.observe(step, loss, 0.001 * step)
    assert quiet.early_climb(len(healthy)) is None
    import random

    wander = 0  # a healthy run whose loss wanders by a fifth step to step (a small-batch fine-tune): rarely a climb
    for seed in range(200):
        r, noisy_run = random.Random(seed), LossTrendDetector(cfg)
        for step in range(1, 33):
            noisy_run.observe(step, 2.0 * (1 + 0.2 * r.gauss(0, 1)), 0.001 * step)
        wander += noisy_run.early_climb(32) is not None
    assert wander <= 6, wander  # (~1% simulated over 2,000 seeds; a median of 8 above its lowest by a fifth: 60%)
    late = LossTrendDetector(cfg)  # a climb once the trend has a best: the band's, not this
    for step, loss in enumerate(megatron_lr_blowup(), 1):
        late.observe(step, loss, 0.003)
    assert late.best is not None and late.early_climb(10 ** 6) is None


S5031_LR = [0.0, 0.0, 0.0226, 0.0358, 0.0452, 0.0524, 0.0584, 0.0634, 0.0677, 0.0716, 0.075, 0.0781, 0.0809, 0.0835,
            0.086, 0.0882, 0.0903, 0.0923, 0.0941, 0.0959, 0.0976, 0.0992, 0.1007, 0.1021]


def test_a_fresh_runs_climb_as_its_lr_rises_is_a_slow_rise_from_its_bottom_before_the_trend_has_a_level():
    """A held-out draw (s5031: no final LayerNorm, 50x its LR) went from 4.85 to 169 in ten steps of its warmup, and
    the trend -- whose level needs 32 steps -- took the climb's top for its best: the loss then "fell", and the first
    verdict came at step 276 of 300 (+8,018% against healthy). The climb from where the run began is a slow_rise once
    the trend has seen min_history steps, its onset the step after the bottom (a young run's restart with a tenth of
    the LR there follows: trainguard.recovery.lrcut) -- once; not the healthy draw's falling loss, nor the same climb
    at a flat LR (a climb that says nothing of the LR), nor a history that begins mid-run."""
    plain = [4.85, 4.85, 4.85, 4.76, 5.13, 43.54, 43.4, 54.84, 228.43, 105.49, 167.95, 411.16, 432.06, 707.45, 585.52,
             895.11, 877.53, 967.85, 638.63, 585.46, 1092.23, 1056.85, 1648.38, 1506.06]
    healthy = [4.85, 4.85, 4.85, 4.84, 4.81, 4.79, 4.76, 4.73, 4.66, 4.59, 4.48, 4.29, 4.06, 4.05, 3.75, 3.32, 3.25, 3.03,
               3.13, 3.11, 3.13, 2.6, 2.48, 2.37]

    def verdicts(losses, lrs, first=1):
        trend = LossTrendDetector(LossTrendConfig())
        return [(step, v) for step, (x, lr) in enumerate(zip(losses, lrs), first)
                if (v := trend.observe(step, x, lr)) is not None]
    (step, v), = verdicts(plain, S5031_LR)
    assert step == LossTrendConfig().min_history and v.anomaly == "slow_rise" and v.detail["early"]
    assert v.detail["onset_step"] == v.detail["bottom_step"] + 1 <= 6 and "LR rose" in v.detail["evidence"][1]
    assert verdicts(healthy, S5031_LR) == []
    assert verdicts(plain, [0.05] * len(plain)) == []  # (a flat LR)
    assert verdicts(plain, S5031_LR, first=400) == []  # (a history that begins mid-run: no start to climb from)


def test_an_early_climb_is_a_verdict_only_while_it_stands_above_where_the_run_began_on_its_first_trajectory():
    """The review of the rule (do no harm): a bump the loss came back from before the trend could give a verdict is no
    climb; a loss that fell and drifts back up (a source of data after another, a curriculum) has not climbed above
    where it began; a climb at a flat LR is never a verdict, not even once the LR rises later (the trend has its level
    by then); after a rollback the first trajectory's judgement is over; the state travels."""
    import json

    lrs = [0.001 * s for s in range(1, 80)]

    def verdicts(losses, lrs, trend=None, first=1):
        trend = trend or LossTrendDetector(LossTrendConfig())
        return [(step, v.detail.get("early")) for step, (x, lr) in enumerate(zip(losses, lrs), first)
                if (v := trend.observe(step, x, lr)) is not None]
    bump = [4.85] * 3 + [6.5, 6.6, 6.4, 6.7, 6.5, 6.6, 6.4, 6.5] + [4.5 - 0.01 * i for i in range(30)]
    trend = LossTrendDetector(LossTrendConfig())
    assert verdicts(bump, lrs, trend) == [] and trend.early_climb(11) == 3  # (named: the bf16 start-over's evidence,
    assert verdicts([4.1 - 0.02 * i for i in range(20)], lrs[41:], trend, first=42) == []  # until the run learns:
    assert trend.early_climb(11) is None  # 20% below where it began)
    trend = LossTrendDetector(LossTrendConfig())
    assert verdicts(bump, [0.001] * len(bump), trend) == [] and trend.early_climb(11) is None  # (a flat LR: nothing)
    old = trend.state_dict()  # (a state of the rule before it measured from the start: nothing named on it)
    old.update(bottom=[3, 4.85], climb=[3, 11], began=None, early_rose=True)
    trend.load_state_dict(json.loads(json.dumps(old)))
    assert trend.early_climb(11) is None
    drift = [4.85, 4.8, 4.7] + [4.7 - 0.1 * i for i in range(15)] + [3.3 + 0.06 * i for i in range(20)]
    assert verdicts(drift, lrs) == []  # (3.3 -> 4.4: a third above its low, below where it began)
    flat_then_raised = [4.85] * 3 + [7.0] * 60
    assert verdicts(flat_then_raised, [0.001] * 40 + [0.01] * 23) == []
    climbing = [4.85] * 3 + [7.0 + 0.1 * i for i in range(30)]
    trend = LossTrendDetector(LossTrendConfig())
    assert verdicts(climbing[:15], lrs, trend) == []  # (before min_history)
    trend.rolled_back(12)  # (a rollback before the verdict: its trajectory is another's)
    assert verdicts(climbing[15:], lrs[15:], trend, first=16) == []
    trend = LossTrendDetector(LossTrendConfig())
    assert verdicts(climbing[:15], lrs, trend) == []
    again = LossTrendDetector(LossTrendConfig())  # (a resume at step 15 with the guard's state: the same verdict, once
    again.load_state_dict(json.loads(json.dumps(trend.state_dict())))  # its window of 8 losses has filled again)
    assert verdicts(climbing[15:], lrs[15:], again, first=16) == [(23, True)]
    assert verdicts(climbing[15:], lrs[15:], trend, first=16) == [(20, True)]
