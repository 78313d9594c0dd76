from trainguard.config import NonfiniteConfig, RecoveryConfig
from trainguard.detectors.base import Verdict
from trainguard.events import Action
from trainguard.policy import Policy


def v(anomaly, rank=1):
    return Verdict("x", anomaly, (rank,), {})


def test_nonfinite_ladder_skips_twice_then_rolls_back_from_the_first_occurrence():
    p = Policy(NonfiniteConfig(), RecoveryConfig())
    assert p.decide([v("nonfinite")], step=10).action is Action.SKIP_STEP
    assert p.decide([], step=11).action is Action.CONTINUE
    assert p.decide([v("nonfinite")], step=30).action is Action.SKIP_STEP
    d = p.decide([v("nonfinite")], step=50)
    assert d.action is Action.ROLLBACK and d.onset_step == 10 and d.anomaly == "nonfinite" and not d.lower_lr


def test_old_occurrences_fall_out_of_the_window():
    p = Policy(NonfiniteConfig(), RecoveryConfig(ladder_window=100))
    for step in (10, 30, 200):
        d = p.decide([v("nonfinite")], step=step)
    assert d.action is Action.SKIP_STEP  # 10 and 30 are more than 100 steps before 200


def test_burst_and_rise_ladders_and_severity():
    p = Policy(NonfiniteConfig(), RecoveryConfig())
    d = p.decide([v("instant_burst")], step=40)
    assert d.action is Action.ROLLBACK and d.onset_step == 40 and not d.lower_lr
    d = p.decide([v("slow_rise"), v("grad_surge")], step=60, rise_onset=47)
    assert d.action is Action.ROLLBACK and d.lower_lr and d.onset_step == 47 and d.anomaly == "slow_rise"
    # alerts alone never act
    assert p.decide([v("entropy_collapse"), v("grad_surge")], step=61).action is Action.CONTINUE


def test_budgets_abort_with_what_was_tried():
    p = Policy(NonfiniteConfig(), RecoveryConfig(max_rollbacks=1, rollback_window=100))
    assert p.decide([v("instant_burst")], step=10).action is Action.ROLLBACK
    p.rolled_back(10, False, {"to_tag": "t"})
    d = p.decide([v("instant_burst")], step=20)
    assert d.action is Action.ABORT and "rollback budget exhausted" in d.reason
    assert p.decide([v("instant_burst")], step=200).action is Action.ROLLBACK  # the window moved on

    q = Policy(NonfiniteConfig(), RecoveryConfig(lr_factor=0.5, lr_floor=0.3))
    q.rolled_back(5, True, {})
    d = q.decide([v("slow_rise")], step=50)
    assert d.action is Action.ABORT and "lr_floor" in d.reason  # 0.5 * 0.5 < 0.3


def test_custom_ladder_and_recovery_off():
    p = Policy(NonfiniteConfig(), RecoveryConfig(ladders={"instant_burst": ["alert", "skip_step", "abort"]}))
    assert [p.decide([v("instant_burst")], step=s).action for s in (1, 2, 3)] == \
        [Action.CONTINUE, Action.SKIP_STEP, Action.ABORT]
    off = Policy(NonfiniteConfig(), RecoveryConfig(enabled=False))
    assert off.decide([v("instant_burst")], step=1).action is Action.CONTINUE
    assert off.decide([v("nonfinite")], step=2).action is Action.SKIP_STEP
    state = p.state_dict()
    r = Policy(NonfiniteConfig(), RecoveryConfig())
    r.load_state_dict(state)
    assert r.state_dict() == state
