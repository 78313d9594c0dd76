import math

import torch

from trainguard.config import NonfiniteConfig, parse_block
from trainguard.detectors import RankObservation, detect_nonfinite
from trainguard.events import Action, Event
from trainguard.step.guard import StepGuard
from trainguard.ranks.isolation import FIELDS, F, observations
from trainguard.metrics.jsonl import read
from trainguard.recovery.policy import Policy


def ob(rank, loss=1.0, grad=1.0, bad=0):
    return RankObservation(rank=rank, loss=loss, micro_batches=1, loss_nonfinite=bad, grad_norm=grad)


def test_healthy_step_has_no_verdict():
    assert detect_nonfinite([ob(0), ob(1)]) is None


def test_culprits_and_origin():
    v = detect_nonfinite([ob(0), ob(1, loss=float("nan"), grad=float("nan"), bad=1), ob(2, grad=float("inf"))])
    assert v.ranks == (1, 2)
    assert v.detail["per_rank"][1]["origin"] == "loss"
    assert v.detail["per_rank"][2]["origin"] == "gradients"


def test_unchecked_gradients_are_not_a_verdict():
    assert detect_nonfinite([ob(0, grad=None)]) is None


def test_policy_skips_then_aborts_after_max_consecutive():
    p = Policy(NonfiniteConfig(max_consecutive=3))
    bad = [detect_nonfinite([ob(0, loss=float("nan"), bad=1)])]
    assert p.decide(bad).action is Action.SKIP_STEP
    assert p.decide([]).action is Action.CONTINUE          # a healthy step resets the streak
    assert p.decide(bad).action is Action.SKIP_STEP
    assert p.decide(bad).action is Action.SKIP_STEP
    d = p.decide(bad)
    assert d.action is Action.ABORT and "3 non-finite steps in a row" in d.reason
    state = p.state_dict()
    q = Policy(NonfiniteConfig(max_consecutive=3))
    q.load_state_dict(state)
    assert q.state_dict() == state


def test_policy_abort_action():
    p = Policy(NonfiniteConfig(action="abort"))
    assert p.decide([detect_nonfinite([ob(0, loss=float("inf"), bad=1)])]).action is Action.ABORT


def test_observations_undo_loss_scale_and_accumulation():
    row = [0.0] * len(FIELDS)
    row[F["loss_sum"]] = 6.0
    row[F["micro_batches"]] = 3
    row[F["grad_sq"]] = (1024.0 / 3) ** 2  # a norm of 1, scaled by 1024 and divided by 3 micro-batches
    row[F["grad_checked"]] = 10
    (o,) = observations([row], loss_scale=1024.0, grad_divisor=3)
    assert o.loss == 2.0 and math.isclose(o.grad_norm, 1.0)


def test_guard_methods_equal_the_events():
    """One loop point per Event member, each callable: the guard and the event vocabulary cannot drift apart."""
    assert all(callable(getattr(StepGuard, f"on_{e.value}")) for e in Event)
    assert {f"on_{e.value}" for e in Event} == {n for n in dir(StepGuard) if n.startswith("on_")}


def _one_step(guard, step, loss_value, grads):
    loss = torch.tensor(loss_value, requires_grad=False)
    guard.on_batch([step * 10, step * 10 + 1], None)
    guard.on_loss(step, loss)
    for g in grads:
        guard.on_backward(g)
    obs = guard.on_agree(step)
    decision = guard.on_decide(step, obs)
    guard.on_step(step, decision, applied=decision.action is Action.CONTINUE)
    guard.on_end(step, obs, {"grad_norm": None, "lr": 0.1, "loss_scale": 1.0, "skipped_steps": 0})
    return obs, decision


def test_guard_single_process_step_cycle(tmp_path):
    cfg = parse_block({"metrics": {"jsonl": str(tmp_path / "log.jsonl"), "per_rank": True}})
    g = StepGuard(cfg, rank=0, world=1)
    from trainguard.ranks.isolation import RankCoords
    g.on_begin([RankCoords(0, 0, 0, 0, "h", 0)], {"framework": "none"})
    obs, d = _one_step(g, 1, 2.0, [torch.ones(4), torch.ones(5)])
    assert d.action is Action.CONTINUE and obs[0].loss == 2.0 and math.isclose(obs[0].grad_norm, 3.0, rel_tol=1e-6)
    obs, d = _one_step(g, 2, 2.0, [torch.tensor([1.0, float("nan")])])
    assert d.action is Action.SKIP_STEP and obs[0].loss_finite and not obs[0].grad_finite
    g.on_close()
    lines = read(tmp_path / "log.jsonl")
    events = [x["event"] for x in lines if x["type"] == "event"]
    assert events == ["run_start", "nonfinite", "run_end"]
    nf = next(x for x in lines if x.get("event") == "nonfinite")
    assert nf["step"] == 2 and nf["ranks"] == [0] and nf["detail"]["per_rank"]["0"]["sample_ids"] == [20, 21]
    metrics = [x for x in lines if x["type"] == "metric"]
    assert [m["step"] for m in metrics] == [1, 2] and metrics[1]["guard_skipped_steps"] == 1
    rank_lines = read(tmp_path / "log.rank0.jsonl")
    assert [m["sample_ids"] for m in rank_lines if m["type"] == "metric"] == [[10, 11], [20, 21]]


def test_guard_abort_report_names_everything(tmp_path):
    cfg = parse_block({"detectors": {"nonfinite": {"action": "abort"}},
                       "metrics": {"jsonl": str(tmp_path / "log.jsonl")}})
    g = StepGuard(cfg, rank=0, world=1)
    from trainguard.ranks.isolation import RankCoords
    g.on_begin([RankCoords(0, 0, 0, 0, "node7", 0)], {})
    _, d = _one_step(g, 5, float("nan"), [])
    assert d.action is Action.ABORT
    err = g.abort(5, d)
    assert err.report["step"] == 5 and err.report["coords"]["0"]["host"] == "node7"
    assert err.report["samples"]["0"]["sample_ids"] == [50, 51]
    assert any(x.get("event") == "abort" for x in read(tmp_path / "log.jsonl"))


def test_origin_within_model_parallel_groups():
    """A NaN spreads inside a model-parallel group (same dp index): the earliest first-bad module is
    the origin, else the rank whose loss was non-finite; data-parallel replicas are judged alone."""
    from trainguard.verdicts import Verdict
    from trainguard.ranks.attribution import narrow_to_origin
    from trainguard.ranks.isolation import RankCoords

    coords = [RankCoords(rank=r, dp=r // 2, tp=0, pp=r % 2, host="h", local_rank=r) for r in range(4)]
    per_rank = {0: {"origin": "gradients"}, 1: {"origin": "loss"}, 2: {"origin": "loss"}, 3: {"origin": "loss"}}
    v = Verdict("nonfinite", "nonfinite", (0, 1, 2, 3), {"per_rank": per_rank})
    everyone = dict(enumerate([{"localized": {"origin_order": [0, 7]}}, {"localized": {"origin_order": [1, 2]}},
                               {"localized": None}, {"localized": {"module": "x", "order": 3}}]))  # DeepSpeed's "order": ignored
    out = narrow_to_origin(v, everyone, coords)
    # group dp=0: stage 0's module came first -> rank 0; group dp=1: no module orders -> the loss ranks (2, 3)
    assert out.ranks == (0, 2, 3) and out.detail["affected_ranks"] == [0, 1, 2, 3]
    assert set(out.detail["per_rank"]) == {0, 2, 3}
    # pure data parallelism (DeepSpeed): every rank is its own group, nothing changes
    flat = [RankCoords(rank=r, dp=r, tp=0, pp=0, host="h", local_rank=r) for r in range(4)]
    assert narrow_to_origin(v, everyone, flat) is v
