from trainguard.config import NonfiniteConfig, RecoveryConfig
from trainguard.verdicts import Verdict
from trainguard.events import Action
from trainguard.recovery.lrcut import LrHistory
from trainguard.recovery.policy import Policy


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
    p = Policy(NonfiniteConfig(), RecoveryConfig(max_rollbacks=1, rollback_window=100, when_exhausted="abort"))
    assert p.decide([v("instant_burst")], step=10).action is Action.ROLLBACK
    p.rolled_back(10, False, {"to_tag": "t"})
    d = p.decide([v("instant_burst")], step=20)
    assert d.action is Action.ABORT and "rollback budget exhausted" in d.reason
    assert p.decide([v("instant_burst")], step=200).action is Action.ROLLBACK  # the window moved on

    q = Policy(NonfiniteConfig(), RecoveryConfig(lr_factor=0.5, lr_floor=0.3, when_exhausted="abort"))
    q.rolled_back(5, True, {})
    d = q.decide([v("slow_rise")], step=50)
    assert d.action is Action.ABORT and "lr_floor" in d.reason  # 0.5 * 0.5 < 0.3


def test_a_spent_budget_trains_on_as_the_framework_would_by_default():
    # (a recovery never ends a run its framework would have finished: alerts, a non-finite step still skipped)
    p = Policy(NonfiniteConfig(max_consecutive=100), RecoveryConfig(max_rollbacks=1, rollback_window=100))
    p.rolled_back(10, False, {"to_tag": "t"})
    d = p.decide([v("instant_burst")], step=20)
    assert d.action is Action.CONTINUE and "rollback budget exhausted" in d.reason and "training on" in d.reason
    for s in (30, 31, 32):
        d = p.decide([v("nonfinite")], step=s)
    assert d.action is Action.SKIP_STEP and "rollback budget exhausted" in d.reason
    q = Policy(NonfiniteConfig(), RecoveryConfig(lr_factor=0.5, lr_floor=0.3))
    q.rolled_back(5, True, {})
    d = q.decide([v("slow_rise")], step=50)
    assert d.action is Action.CONTINUE and "lr_floor" in d.reason and q.lr_factor == 0.5


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


def test_fp16_overflow_is_routine_and_the_loss_scale_ladder_climbs():
    from trainguard.config import LossScaleConfig
    from trainguard.verdicts import RankObservation
    from trainguard.detectors.loss_scale import LossScaleWatch
    from trainguard.verdicts import ScalerState
    from trainguard.detectors.nonfinite import detect_nonfinite

    # gradients overflowed with a finite loss: with a dynamic scale, an "overflow" the scaler handles
    ob = RankObservation(rank=1, loss=2.0, micro_batches=1, loss_nonfinite=0, grad_norm=float("inf"))
    assert detect_nonfinite([ob], scaled=True).anomaly == "overflow"
    assert detect_nonfinite([ob], scaled=False).anomaly == "nonfinite"
    p = Policy(NonfiniteConfig(max_consecutive=3), RecoveryConfig())
    for step in range(1, 10):  # never climbs the nonfinite ladder, never counts as consecutive
        d = p.decide([v("overflow")], step=step)
        assert d.action is Action.SKIP_STEP and d.anomaly == "overflow"

    # the watch: halvings are routine; an overflow at the floor is the collapse, its onset the descent's start
    w = LossScaleWatch(LossScaleConfig())
    assert w.observe(1, ScalerState(256, 1, 2), overflowed=False) is None
    assert w.observe(2, ScalerState(256, 1, 2), overflowed=True) is None
    assert w.observe(3, ScalerState(256, 1, 1), overflowed=True) is None
    assert w.observe(4, ScalerState(2, 1, 2), overflowed=True) is None   # hysteresis still absorbs one
    collapse = w.observe(5, ScalerState(1, 1, 1), overflowed=True)
    assert collapse.anomaly == "loss_scale" and collapse.detail["onset_step"] == 2 and collapse.detail["at_floor"]
    # an endless streak once the scaler had found a working scale is a collapse too
    s = LossScaleWatch(LossScaleConfig(max_overflow_streak=3))
    s.observe(1, ScalerState(1024, 1), overflowed=False)
    assert [s.observe(k, ScalerState(1024 / 2 ** k, 1), overflowed=True) is None for k in (2, 3, 4)] == \
        [True, True, False]

    # the default ladder: straight to bf16 (values beyond fp16's range: no scale reset helps)
    assert Policy(NonfiniteConfig(), RecoveryConfig()).decide_loss_scale(collapse, 30).remedy == "bf16_fallback"
    # the three-rung ladder: reset the scale, then raise the floor, then bf16; "none" as fallback aborts instead
    p = Policy(NonfiniteConfig(), RecoveryConfig(max_rollbacks=10,
                                                 ladders={"loss_scale": ["rollback", "raise_floor", "bf16_fallback"]}))
    remedies = []
    for step in (30, 31, 32):
        d = p.decide_loss_scale(collapse, step)
        assert d.action is Action.ROLLBACK and d.onset_step == 2
        p.rolled_back(step, False, {})
        remedies.append(d.remedy)
    assert remedies == ["reset_scale", "raise_floor", "bf16_fallback"]  # (the rungs' names)
    q = Policy(NonfiniteConfig(), RecoveryConfig(fp16_fallback="none", ladders={"loss_scale": ["bf16_fallback"]}))
    d = q.decide_loss_scale(collapse, 30)
    assert d.action is Action.ABORT and "fp16_fallback is 'none'" in d.reason


def test_scale_rungs_only_in_the_loss_scale_ladder():
    import pytest

    from trainguard.errors import ConfigError
    from trainguard.config import parse_block

    with pytest.raises(ConfigError, match="raise_floor.*only to the 'loss_scale' ladder"):
        parse_block({"recovery": {"ladders": {"nonfinite": ["raise_floor"]}}})
    cfg = parse_block({"recovery": {"ladders": {"instant_burst": ["skip_step"]}}})
    assert cfg.recovery.ladders["loss_scale"] == ["bf16_fallback"]  # the others keep theirs


def test_a_spike_soon_after_a_rollback_goes_further_back_a_later_one_does_not():
    p = Policy(NonfiniteConfig(), RecoveryConfig(max_rollbacks=10))
    d = p.decide([v("instant_burst")], step=615)
    assert d.onset_step == 615
    p.rolled_back(615, False, {"to_step": 600, "anomaly": "instant_burst"})
    d = p.decide([v("instant_burst")], step=623)  # 23 steps past the target, it had been 15: did not hold
    assert d.action is Action.ROLLBACK and d.onset_step == 600 and "further back" in d.reason
    p.rolled_back(623, False, {"to_step": 590, "anomaly": "instant_burst"})
    d = p.decide([v("instant_burst")], step=700)  # long after: a new problem, its own onset
    assert d.onset_step == 700 and "further back" not in d.reason
    # non-finite steps are bad data, not a damaged state: never further back; and after the ladder's top
    # rung (the rollback) the episode is over: the next occurrence is skipped again
    q = Policy(NonfiniteConfig(), RecoveryConfig())
    assert [q.decide([v("nonfinite")], step=s).action for s in (90, 91, 92)] == \
        [Action.SKIP_STEP, Action.SKIP_STEP, Action.ROLLBACK]
    q.rolled_back(92, False, {"to_step": 80, "anomaly": "nonfinite"})
    assert q.decide([v("nonfinite")], step=85).action is Action.SKIP_STEP


def test_a_healthy_replay_turns_a_rollback_into_a_skip_and_a_damaged_one_rolls_back_at_once():
    p = Policy(NonfiniteConfig(), RecoveryConfig())
    # a burst of bad batches, every one skipped, the weights replaying healthy: never a rollback
    for step in (10, 11, 12, 13):
        d = p.decide([v("nonfinite")], step=step, weights="healthy")
        assert d.action is Action.SKIP_STEP, (step, d)
    assert "the data was bad" in d.reason
    d = p.decide([v("instant_burst")], step=20, weights="healthy")
    assert d.action is Action.SKIP_STEP and d.anomaly == "instant_burst"
    # damaged weights: the first occurrence rolls back, and the onset step's checkpoint is not a target
    p = Policy(NonfiniteConfig(), RecoveryConfig())
    d = p.decide([v("nonfinite")], step=30, weights="damaged")
    assert d.action is Action.ROLLBACK and d.onset_step == 30 and not d.onset_skipped and "damaged" in d.reason
    # no replay (megatron, replay_check false): the ladder as written
    p = Policy(NonfiniteConfig(), RecoveryConfig())
    assert [p.decide([v("nonfinite")], step=s).action for s in (1, 2, 3)] == \
        [Action.SKIP_STEP, Action.SKIP_STEP, Action.ROLLBACK]
    # a slow rise was applied: the replay does not decide it
    assert p.decide([v("slow_rise")], step=40, weights="healthy").action is Action.ROLLBACK
    # recovery off: skip, whatever the replay says
    p = Policy(NonfiniteConfig(), RecoveryConfig(enabled=False))
    assert p.decide([v("nonfinite")], step=5, weights="damaged").action is Action.SKIP_STEP


def test_an_fp16_forward_overflowing_again_after_a_rollback_goes_to_bf16():
    """Issue 33, natural: fp16 at too high an LR, the loss itself non-finite at the attention softmax on every rank
    (no loss scale changes a forward: it scales the backward). The ladder rolled back again and again until its
    budget aborted the run. The second rollback of such a forward continues in bf16; gradients alone, bf16 runs
    or recovery.fp16_fallback "none" keep the ladder as written."""
    from trainguard.events import Remedy

    def forward(rank=0):
        return Verdict("nonfinite", "nonfinite", (rank,), {"per_rank": {rank: {"origin": "loss"}}})

    def climb(p, fp16, first=10):
        for s in (first, first + 1):
            assert p.decide([forward()], step=s, fp16=fp16).action is Action.SKIP_STEP
        return p.decide([forward(1)], step=first + 2, fp16=fp16)

    p = Policy(NonfiniteConfig(max_consecutive=10), RecoveryConfig())
    d = climb(p, fp16=True)
    assert d.action is Action.ROLLBACK and d.remedy is None  # the first time: a rollback may be enough
    p.rolled_back(12, False, {"to_step": 5, "anomaly": d.anomaly})
    d = climb(p, fp16=True, first=20)
    assert d.action is Action.ROLLBACK and d.remedy is Remedy.BF16_FALLBACK and "range" in d.reason
    assert not d.restart  # (no LR evidence given: from the newest checkpoint before the onset)
    for first, warmup, restart in ((20, 100, True), (20, 1, False), (400, 1000, True), (400, 100, False)):
        # a young run whose LR was still rising into the trouble starts over from its first step -- young measured
        # against its own warmup (trainguard.recovery.lrcut.LrHistory.young), not a step count: 400 steps into a warmup of
        # 1,000 is young, 400 steps after a warmup of 100 is not
        lrs = LrHistory()
        for s in range(1, first + 13):
            lrs.record(s, 0.1 * min(s, warmup) / warmup)
        p = Policy(NonfiniteConfig(max_consecutive=10), RecoveryConfig())
        climb(p, fp16=True, first=first)
        p.rolled_back(first + 2, False, {"to_step": first - 5, "anomaly": "nonfinite"})
        for s in (first + 10, first + 11):
            p.decide([forward()], step=s, fp16=True, lr_rising=lrs.rising_into)
        d = p.decide([forward(1)], step=first + 12, fp16=True, lr_rising=lrs.rising_into)
        assert d.remedy is Remedy.BF16_FALLBACK and d.restart is restart, (first, warmup)
    for fp16, fallback, origin in ((False, "bf16", "loss"), (True, "none", "loss"), (True, "bf16", "gradients")):
        p = Policy(NonfiniteConfig(max_consecutive=10), RecoveryConfig(fp16_fallback=fallback))
        p.rolled_back(12, False, {"to_step": 5, "anomaly": "nonfinite"})
        for s in (20, 21, 22):
            d = p.decide([Verdict("nonfinite", "nonfinite", (0,), {"per_rank": {0: {"origin": origin}}})], step=s,
                         fp16=fp16)
        assert d.action is Action.ROLLBACK and d.remedy is None, (fp16, fallback, origin)
