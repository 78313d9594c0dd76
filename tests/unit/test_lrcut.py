"""The LR cut sized by what the LR did before the climb (trainguard.recovery.lrcut), and the policy that applies it."""
import pytest

from trainguard.config import NonfiniteConfig, RecoveryConfig
from trainguard.verdicts import Verdict
from trainguard.recovery.lrcut import LrHistory
from trainguard.recovery.policy import Action, Policy


def history(lrs: dict) -> LrHistory:
    h = LrHistory()
    for step in sorted(lrs):
        h.record(step, lrs[step])
    return h


def test_a_schedule_raised_mid_run_goes_back_to_the_lr_before_the_jump():
    h = history({s: 0.003 if s < 150 else 0.045 for s in range(1, 156)})
    scale, why, restart = h.cut(onset=151, now=155, configured=0.5)
    assert scale == pytest.approx(1 / 15) and not restart
    assert "jumped x15" in why and "step 150" in why


def test_a_warmup_is_no_jump_and_keeps_the_configured_factor():
    # a ramp still rising into the onset, even one whose first steps double the LR: no jump (in a young run: the
    # young run's rule, a tenth, not a jump's "back to the LR before it")
    h = history({s: 0.05 * min(s, 100) / 100 for s in range(1, 95)})
    for onset in (82, 12):
        scale, why, restart = h.cut(onset=onset, now=94, configured=0.5)
        assert restart and "young run" in why and "jumped" not in why
    # (in a grown run the young rule does not apply either: the configured factor)
    h = history({s: 0.05 * min(s - 300, 100) / 100 for s in range(301, 395)})
    assert h.cut(onset=382, now=394, configured=0.5) == (0.5, "", False)
    assert h.cut(onset=305, now=312, configured=0.5) == (0.5, "", False)


def test_a_steady_lr_in_a_grown_run_keeps_the_configured_factor():
    h = history({s: 0.003 for s in range(300, 700)})
    assert h.cut(onset=600, now=640, configured=0.5) == (0.5, "", False)
    # (a mild rise is no jump, and the cut is never milder than configured)
    h = history({s: 0.003 * (1 + (s - 300) / 4000) for s in range(300, 700)})
    assert h.cut(onset=600, now=640, configured=0.5)[0] == 0.5


def test_a_rollback_forgets_the_undone_steps_lrs():
    h = history({s: 0.003 if s < 150 else 0.045 for s in range(1, 156)})
    h.rewound(100)
    h.record(101, 0.003)
    assert h.cut(onset=90, now=101, configured=0.5)[2]  # (no jump left: a young run's rule)
    assert h.cut(onset=90, now=101, configured=0.5)[0] == pytest.approx(0.1)


def _rise(step: int, onset: int) -> Verdict:
    return Verdict(detector="loss_trend", anomaly="slow_rise", ranks=(0,), detail={"onset_step": onset})


def test_the_policy_applies_the_cut_and_says_why_and_holds_at_the_floor():
    p = Policy(NonfiniteConfig(), RecoveryConfig(lr_floor=0.01))
    d = p.decide([_rise(97, 85)], 97, lr_cut=lambda onset: (0.1, "evidence", False))
    assert d.action is Action.ROLLBACK and d.lower_lr and d.lr_scale == pytest.approx(0.1)
    assert "LR x0.1: evidence" in d.reason
    p.rolled_back(97, True, {"to_step": 50, "anomaly": "slow_rise"}, scale=d.lr_scale)
    assert p.lr_factor == pytest.approx(0.1)
    # a second tenth would pass the floor: held at it (0.01 / 0.1), once
    d = p.decide([_rise(300, 280)], 300, lr_cut=lambda onset: (0.05, "evidence", False))
    assert d.lr_scale == pytest.approx(0.1) and "held at lr_floor" in d.reason
    p.rolled_back(300, True, {"to_step": 250, "anomaly": "slow_rise"}, scale=d.lr_scale)
    assert p.lr_factor == pytest.approx(0.01)
    # (at the floor: trains on as the framework would, alerts only -- recovery.when_exhausted)
    assert p.decide([_rise(500, 480)], 500, lr_cut=lambda onset: (0.5, "", False)).action is Action.CONTINUE


def test_without_a_cut_the_configured_factor_as_before():
    p = Policy(NonfiniteConfig(), RecoveryConfig())
    d = p.decide([_rise(97, 85)], 97)
    assert d.lower_lr and d.lr_scale == 0.5
    p.rolled_back(97, True, {"to_step": 50, "anomaly": "slow_rise"}, scale=d.lr_scale)
    assert p.lr_factor == 0.5


def test_a_young_run_restarts_once_from_its_first_step_with_a_tenth_of_the_lr_at_its_best():
    h = history({1: 0.0, **{s: 0.03 for s in range(2, 98)}})  # a warmup of one step: 0.03 from the start
    scale, why, restart = h.cut(onset=85, now=97, configured=0.5)
    assert restart and scale == pytest.approx(0.1) and "young run" in why
    p = Policy(NonfiniteConfig(), RecoveryConfig())
    d = p.decide([_rise(97, 85)], 97, lr_cut=lambda onset: h.cut(onset, 97, 0.5))
    assert d.restart and d.lr_scale == pytest.approx(0.1)
    p.rolled_back(97, True, {"to_step": 1, "anomaly": "slow_rise", "restart": True}, scale=d.lr_scale)
    # a second climb: halved, an ordinary rollback
    d = p.decide([_rise(150, 120)], 150, lr_cut=lambda onset: h.cut(onset, 97, 0.5))
    assert not d.restart and d.lr_scale == 0.5
    # a burst on a rollback_lower_lr ladder is no evidence about the LR: no restart, the configured factor
    p = Policy(NonfiniteConfig(), RecoveryConfig(ladders={"instant_burst": ["rollback_lower_lr"]}))
    burst = Verdict(detector="loss_spike", anomaly="instant_burst", ranks=(0,), detail={})
    d = p.decide([burst], 30, lr_cut=lambda onset: h.cut(onset, 97, 0.5))
    assert d.lower_lr and not d.restart and d.lr_scale == 0.5


def test_rising_into_an_onset_is_a_warmup_under_way():
    h = history({s: 0.1 * min(s, 100) / 100 for s in range(1, 90)})
    assert h.rising_into(56) and h.rising_into(10)
    h = history({s: 0.003 for s in range(1, 90)})
    assert not h.rising_into(56)
    h = history({1: 0.0, **{s: 0.03 for s in range(2, 90)}})  # (a warmup of one step: from 0, within RAMP)
    assert h.rising_into(20) and not h.rising_into(60)


def test_the_lr_history_rides_the_guards_state_so_a_resume_at_a_raised_schedule_sees_the_jump():
    before = history({s: 0.003 for s in range(1, 151)})
    resumed = LrHistory()
    resumed.load_state_dict(before.state_dict())
    for s in range(151, 156):
        resumed.record(s, 0.045)
    scale, why, restart = resumed.cut(onset=152, now=155, configured=0.5)
    assert scale == pytest.approx(1 / 15) and not restart and "jumped" in why


def test_a_lowered_lr_expires_with_its_cooldown_and_a_later_cut_starts_from_the_schedule():
    p = Policy(NonfiniteConfig(), RecoveryConfig())
    p.lower_lr(0.1)
    p.lr_until = 1001
    assert p.lr_applied(500) == pytest.approx(0.1)
    assert p.lr_applied(1001) == 1.0 and p.lr_factor == 1.0  # (forgotten: no longer applied)
    d = p.decide([_rise(1200, 1150)], 1200, lr_cut=lambda onset: (0.1, "jump", False))
    assert d.lr_scale == pytest.approx(0.1) and "held at lr_floor" not in d.reason
    state = p.state_dict()
    assert Policy(NonfiniteConfig(), RecoveryConfig()).load_state_dict(state) is None and state["lr_until"] == 1001


def test_a_cut_the_schedules_own_lr_called_for_outlives_its_cooldown():
    """A young run's or a jump's cut says the schedule's LR is what fails: when the cooldown ended it came back and
    the run failed again (a 2,000-step run, cooldown 1,000). An ordinary halving on top of it expires back to it."""
    p = Policy(NonfiniteConfig(), RecoveryConfig())
    d = p.decide([_rise(60, 2)], 60, lr_cut=lambda onset: (0.1, "a young run", True))
    assert d.lasting and d.restart and "for the rest of the run" in d.reason
    p.rolled_back(60, True, {"to_step": 1, "restart": True, "anomaly": "slow_rise"}, scale=d.lr_scale, until=1001,
                  lasting=d.lasting)
    assert p.lr_applied(1000) == pytest.approx(0.1) and p.lr_applied(5000) == pytest.approx(0.1)
    ordinary = p.decide([_rise(1500, 1450)], 1500, lr_cut=lambda onset: (0.5, "", False))
    assert not ordinary.lasting and "for the rest of the run" not in ordinary.reason
    p.lower_lr(ordinary.lr_scale, until=2500, lasting=ordinary.lasting)
    assert p.lr_applied(2000) == pytest.approx(0.05) and p.lr_applied(2500) == pytest.approx(0.1)
    again = Policy(NonfiniteConfig(), RecoveryConfig())
    again.load_state_dict(p.state_dict())
    assert again.lr_applied(9000) == pytest.approx(0.1)


def test_only_a_cut_the_evidence_sized_lasts_and_it_lasts_at_the_lr_the_evidence_named():
    """A jump of 1.6x sizes a milder cut than a halving: the halving is ordinary (it expires). A young run's tenth taken
    while an ordinary halving is in its cooldown names an LR a tenth of the one applied -- 0.05 of the schedule's --:
    that is what lasts (x0.1 kept of the schedule would leave it 2x too high when the halving expires)."""
    h = LrHistory()
    for s in range(1, 61):
        h.record(s, 0.01 if s < 50 else 0.016)  # (a schedule raised 1.6x at step 50)
    assert h.cut(onset=52, now=60, configured=0.5) == (0.5, "", False)  # (milder than a halving: the halving, no claim)
    for s in range(1, 61):
        h.record(s, 0.01 if s < 50 else 0.02)   # (raised 2x: back to the LR before it, which is the evidence's)
    assert h.cut(onset=52, now=60, configured=0.5)[:2] == (0.5, "the LR jumped x2 at step 50: back to the LR before it (0.01)")
    p = Policy(NonfiniteConfig(), RecoveryConfig())
    mild = p.decide([_rise(60, 55)], 60, lr_cut=lambda onset: (0.5, "", False))
    assert mild.lr_scale == 0.5 and not mild.lasting
    p.lower_lr(mild.lr_scale, until=1060, lasting=mild.lasting)
    young = p.decide([_rise(100, 90)], 100, lr_cut=lambda onset: (0.1, "a young run", True))
    assert young.lasting
    p.lower_lr(young.lr_scale, until=1100, lasting=young.lasting)
    assert p.lr_applied(500) == pytest.approx(0.05) and p.lr_applied(5000) == pytest.approx(0.05)


def test_the_runs_length_is_read_where_its_loop_goes_on_through_a_rollback():
    """LrHistory.no_room's input, as each framework says it: HF's Trainer builds its schedule with the run's
    length (transformers' get_scheduler: a LambdaLR over a partial holding num_training_steps) or fills DeepSpeed's
    ``total_num_steps``; Megatron-LM's ``--train-iters``. DeepSpeed's own loop rewinds with the weights: no length."""
    from types import SimpleNamespace

    import torch
    from transformers import get_scheduler

    from ds_plugins.facts import _last_step
    from megatron_hooks.lm import LMRun

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    for kind in ("linear", "cosine"):
        sched = get_scheduler(kind, opt, num_warmup_steps=10, num_training_steps=700)
        assert _last_step(SimpleNamespace(lr_scheduler=sched), None) == 700
    constant = get_scheduler("constant", opt)
    assert _last_step(SimpleNamespace(lr_scheduler=constant), None) is None
    ds = {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 5, "total_num_steps": 300}}
    assert _last_step(SimpleNamespace(lr_scheduler=None), ds) == 300
    assert _last_step(SimpleNamespace(lr_scheduler=None), {"type": "WarmupDecayLR",
                                                           "params": {"total_num_steps": "auto"}}) is None
    assert LMRun.last_step(SimpleNamespace(margs=SimpleNamespace(train_iters=150))) == 150
    assert LMRun.last_step(SimpleNamespace(margs=SimpleNamespace(train_iters=None))) is None
    h = LrHistory()
    h.last_step = 150
    assert "throw away 139 steps with 10 left" in h.no_room(140) and h.no_room(75) is None
    h.last_step = None
    assert h.no_room(140) is None


def test_a_rollback_for_a_creep_that_would_throw_away_more_than_the_run_has_left_keeps_the_progress():
    """bench/natural's Megatron-LM peers (one-step warmup): a creep named at iteration 140 of 150 rolled back to the
    checkpoint of 50 (the newest before the onset, 96) -- 90 iterations thrown away, 10 left to re-train them: 4.168
    where plain ended 3.860. Going back costs more steps than the run has left, and the loss then (4.23) was above
    the loss now (3.85): the climb took none of the progress back, nothing to go back for. Where the loss now is
    above the target's, the climb damaged the weights and the rollback goes back to better ones; where either loss
    is unknown, or the run has the room, or its count rewinds with the weights (no last step): the rollback."""
    h = LrHistory()
    h.last_step = 150
    assert h.no_room(140, 50, now=3.85, then=4.23, restart=False) == \
        "no rollback to step 50: it would throw away 90 steps with 10 left (the run ends at step 150)"
    assert h.no_room(140, 50, now=7.3, then=4.23, restart=False) is None  # (the climb made it worse: better back there)
    assert h.no_room(140, 50, now=3.85, then=None, restart=False) is None  # (unknown: the rollback, as before)
    assert h.no_room(140, 1, now=None, then=None, restart=False) is None   # (a snapshot of step 1 is no restart)
    assert h.no_room(90, 50, now=3.85, then=4.23, restart=False) is None   # (60 left for the 40 it throws away)
    assert h.no_room(140, 1) is not None and h.no_room(70, 1) is None  # (the first step's restart: the count alone)
    h.last_step = None
    assert h.no_room(140, 50, now=3.85, then=4.23, restart=False) is None


def test_the_lr_range_cut_is_a_tenth_of_the_lr_where_the_loss_stopped_falling():
    """A young run's bf16 start-over whose loss climbed above where it began (trainguard.step.judgement): a tenth of
    the LR at the loss's bottom, against the LR now -- a warmup of one step's included (the climb began at its peak);
    none where the LR fell since (a decay: not the LR the loss climbed at)."""
    h = history({s: 0.15 * min(s, 100) / 100 for s in range(1, 40)})
    scale, why = h.range_cut(4, 38)
    assert scale == pytest.approx(0.1 * 0.006 / 0.057) and "step 4" in why and "range test" in why
    assert history({1: 0.0, **{s: 0.075 for s in range(2, 40)}}).range_cut(3, 38)[0] == pytest.approx(0.1)
    assert history({s: 0.003 * (0.99 ** s) for s in range(1, 40)}).range_cut(4, 38) is None
    assert history({s: 0.15 for s in range(100, 300)}).range_cut(4, 299) is None  # (older than the LRs kept)
