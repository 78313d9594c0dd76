"""The replica check (trainguard/detectors/replica.py) on its own, and how the ladders take a registered
detector's verdict: found by the registry, one AGREE column, its onset honoured by the policy."""
import torch

from trainguard.config import NonfiniteConfig, ReplicaCheckConfig, RecoveryConfig, parse_block
from trainguard.verdicts import RankObservation
from trainguard.detectors.registry import Decide, columns, registrations
from trainguard.detectors.replica import ReplicaCheck, digest
from trainguard.events import Action, Anomaly, Record
from trainguard.faults.injector import flip_bit
from trainguard.ranks.isolation import RankCoords
from trainguard.recovery.policy import Policy


def test_one_flipped_bit_changes_the_digest_in_every_dtype():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        params = [torch.randn(64, generator=g).to(dtype), torch.randn(3, 5, generator=g).to(dtype)]
        base = digest(params)
        for bit in range(8 * params[0].element_size()):
            flipped = [params[0].clone(), params[1]]
            flip_bit(flipped[0], bit)
            assert digest(flipped) != base, (dtype, bit)
        assert digest([p.clone() for p in params]) == base  # (the same bits: the same digest)


def _obs(values):
    return [RankObservation(rank=r, loss=1.0, micro_batches=1, loss_nonfinite=0, grad_norm=1.0,
                            extra={"replica_digest": v}) for r, v in enumerate(values)]


def _coords(tp):
    return [RankCoords(rank=r, dp=r // (max(tp) + 1), tp=t, pp=0, host=f"h{r}", local_rank=r) for r, t in enumerate(tp)]


def test_the_minority_of_a_replica_group_is_named_and_without_a_majority_the_whole_group():
    det = ReplicaCheck(ReplicaCheckConfig(enabled=True, every_steps=5))
    assert det.observe(5, Decide(_obs([7.0, 7.0, 7.0]), _coords([0, 0, 0]))) == [] and det.agreed_at == 5
    assert det.observe(7, Decide(_obs([7.0, 8.0, 7.0]), _coords([0, 0, 0]))) == []  # (not a check step)
    (v,) = det.observe(10, Decide(_obs([7.0, 9.0, 7.0]), _coords([0, 0, 0])))
    assert v.anomaly is Anomaly.REPLICA_MISMATCH and v.ranks == (1,) and v.detail["majority"] and v.detail["suspect"]
    assert v.detail["onset_step"] == 5 and det.agreed_at == 5  # (no agreement at 10: it stays)
    (v,) = det.observe(15, Decide(_obs([7.0, 9.0]), _coords([0, 0])))
    assert v.ranks == (0, 1) and not v.detail["majority"] and v.detail["suspect"] is None
    # tensor parallel: ranks of different TP coordinates hold different shards -- compared within a group only
    tp = _coords([0, 1, 0, 1])
    assert det.observe(20, Decide(_obs([1.0, 2.0, 1.0, 2.0]), tp)) == []
    (v,) = det.observe(25, Decide(_obs([1.0, 2.0, 1.0, 3.0]), tp))
    assert sorted(v.detail["group"]) == [1, 3] and v.ranks == (1, 3) and v.detail["onset_step"] == 20


def test_a_registered_detectors_verdict_climbs_its_ladder_from_its_onset():
    assert "replica_digest" in columns() and any(r.key == "replica_check" for r in registrations())
    assert Record(Anomaly.REPLICA_MISMATCH.value) is Record.REPLICA_MISMATCH
    det = ReplicaCheck(ReplicaCheckConfig(enabled=True, every_steps=5))
    det.observe(5, Decide(_obs([7.0, 7.0, 7.0]), _coords([0, 0, 0])))
    verdicts = det.observe(10, Decide(_obs([7.0, 9.0, 7.0]), _coords([0, 0, 0])))
    d = Policy(NonfiniteConfig(), RecoveryConfig()).decide(verdicts, 10)
    # the checkpoints from before the last agreeing check (5) are the clean ones
    assert d.action is Action.ROLLBACK and d.anomaly is Anomaly.REPLICA_MISMATCH and d.onset_step == 5
    cfg = parse_block({"detectors": {"replica_check": {"enabled": True}}})
    assert cfg.recovery.ladders["replica_mismatch"] == ["rollback"]


def test_a_rank_a_registered_detector_is_sure_of_has_its_host_written_for_the_next_allocation(tmp_path):
    """detail["suspect"]: the guard names the rank suspect and writes its host to suspect_hosts.json (what
    scripts/launch excludes on a restart) -- the replica check does so when a majority outvotes the rank."""
    import json

    from trainguard.verdicts import Verdict
    from trainguard.step.guard import StepGuard

    cfg = parse_block({"metrics": {"jsonl": str(tmp_path / "tg.jsonl")}, "checks": {"enabled": False}})
    guard = StepGuard(cfg, 0, 1)

    class Outvoted:
        def local(self, step):
            return None

        def observe(self, step, ctx):
            return [Verdict("replica_check", Anomaly.REPLICA_MISMATCH, (0,),
                            {"suspect": "weights differ from the majority of its replicas", "onset_step": 5})]

    # (the replica check's slot taken by one that is sure of rank 0; every other detector as in a real guard)
    order = registrations()
    replica = next(r for r in order if r.key == "replica_check")
    guard.detectors.registered = sorted([*guard.detectors.registered, (replica, Outvoted())], key=lambda rd: order.index(rd[0]))
    guard.on_begin([RankCoords(rank=0, dp=0, tp=0, pp=0, host="node-7", local_rank=0)], {})
    decision = guard.on_decide(10, guard.on_agree(10))
    assert decision.action is Action.ROLLBACK and decision.onset_step == 5
    assert json.loads((tmp_path / "suspect_hosts.json").read_text())["hosts"] == ["node-7"]
    guard.on_close()
    lines = [json.loads(x) for x in (tmp_path / "tg.jsonl").read_text().splitlines()]
    (rec,) = [x for x in lines if x.get("event") == "suspect_rank"]
    assert rec["detail"]["host"] == "node-7" and "majority" in rec["detail"]["why"]
