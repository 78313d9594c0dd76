"""Peer replay (detectors.peer_replay): who replays whose micro-batch, the arbitration, the spike rule, and the
plain payload -- every rank of a small world run as a thread over a stand-in transport, each replaying with a
real torch model whose 'device' may compute wrong."""
import threading

import pytest
import torch

from trainguard.replay import p2p
from trainguard.config import PeerReplayConfig
from trainguard.verdicts import PeerContext
from trainguard.detectors.peer_replay import PeerReplay, arbitrate, pairs, replica_groups, same
from trainguard.detectors.registry import Decide
from trainguard.faults.poison import OutputPoison
from trainguard.ranks.isolation import RankCoords
from trainguard.replay.replay import MicroBatch


class World:
    """A stand-in for the process group: point-to-point sends and an all-gather between threads."""

    def __init__(self, n):
        self.n = n
        self.barrier = threading.Barrier(n, timeout=30)
        self.mail: dict = {}
        self.rows: dict = {}
        self.lock = threading.Lock()

    def transport(self, rank):
        world = self

        class T:
            def exchange(self, sends, receives, device, group):
                with world.lock:
                    for peer, data in sends.items():
                        world.mail[(rank, peer)] = data
                world.barrier.wait()
                got = {p: world.mail[(p, rank)] for p in receives}
                world.barrier.wait()
                return got

            def all_gather(self, row, device, group):
                with world.lock:
                    world.rows[rank] = list(row)
                world.barrier.wait()
                out = [world.rows[r] for r in range(world.n)]
                world.barrier.wait()
                return out
        return T()


def coords(n, tp=1):
    return [RankCoords(rank=r, dp=r // tp, tp=r % tp, pp=0, host=f"h{r}", local_rank=0) for r in range(n)]


torch.manual_seed(0)
MODEL = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def replayer(wrong: bool):
    """(inputs, seed) -> (loss, digest) on the shared weights; ``wrong``: this rank's device scales a layer's output."""
    from trainguard.detectors.replica import digest

    def run(payload, seed):
        inputs, rng = payload
        x = inputs["x"]
        with torch.no_grad():
            h = MODEL[0](x) * (1.001 if wrong else 1.0)
            out = MODEL[2](MODEL[1](h))
        return float(out.pow(2).mean()), float(digest([out]))
    return run


def run_world(n, wrong=(), step=10, every=5, unexplained=(), step_loss=None, rtol=0.0, tp=1, batches=None,
              measured=None):
    world = World(n)
    cs = coords(n, tp)
    found = {}

    def rank_main(r):
        det = PeerReplay(PeerReplayConfig(enabled=True, every_steps=every, rtol=rtol))
        det.transport = world.transport(r)
        inputs = batches[r] if batches else {"x": torch.randn(3, 8, generator=torch.Generator().manual_seed(r))}
        mb = MicroBatch(inputs)
        if measured is not None:  # (the adapter's own measure of its training forward: (loss, digest))
            mb.value = measured(r, inputs)
        ctx = PeerContext(rank=r, coords=cs, device=torch.device("cpu"), group=None, batch=mb,
                          replay=replayer(r in wrong), healthy=lambda loss: loss < 5.0, unexplained=unexplained,
                          step_loss=dict(enumerate(step_loss or [1.0] * n)))
        det.exchange(step, ctx)
        found[r] = det.observe(step, Decide([], cs))

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(found) == n, "a rank did not finish (a hang in the exchange)"
    first = found[0]
    assert all(f == first for f in found.values()), "the ranks reached different verdicts"
    return first


def test_groups_and_pairs_follow_the_data_parallel_order():
    assert replica_groups(coords(4, tp=2)) == [[0, 2], [1, 3]]
    assert pairs([[0, 1, 2]]) == [(0, 1), (1, 2), (2, 0)]
    assert same((1.0, 2.0), (1.0, 2.0), 0) and same((1.0, 2.0), (1.0, 3.0), 0) is False
    assert same((1.0, 2.0), (1.0 + 1e-9, 3.0), 1e-6) and same((float("nan"),) * 2, (1.0, 2.0), 0) is None


def test_a_wrong_device_among_three_replicas_is_named_alone_on_a_sampled_step():
    (v,) = run_world(3, wrong={1})
    assert v.anomaly == "compute_mismatch" and v.ranks == (1,) and v.detail["suspect"]
    for e in v.detail["evidence"]["1"]:
        assert e["majority"] and e["replays"]["0"] == e["replays"]["2"] != e["replays"]["1"]


def test_with_two_replicas_both_are_named_and_neither_is_suspect():
    (v,) = run_world(2, wrong={0})
    assert v.ranks == (0, 1) and v.detail["suspect"] is None


def test_healthy_replicas_and_unsampled_steps_give_nothing():
    assert run_world(3) == []
    assert run_world(3, wrong={1}, step=11) == []  # (not a sampled step, no spike: nothing replayed)


def test_model_parallel_groups_replay_in_lockstep_and_name_the_replica():
    """TP=2 x DP=3: ranks with the same TP coordinate are replicas; a wrong rank is named in its own group."""
    (v,) = run_world(6, wrong={3}, tp=2)
    assert v.ranks == (3,)


def test_a_spike_no_replay_reproduces_names_the_culprit():
    """Off the sample (step 11): the culprit's micro-batch replays healthy on it and its peer alike, while its
    training forward gave a spike -- its training compute is named."""
    (v,) = run_world(3, step=11, unexplained=[2], step_loss=[1.0, 1.0, 40.0])
    assert v.ranks == (2,)
    (e,) = v.detail["evidence"]["2"]
    assert e["step_loss"] == 40.0 and e["replayer"] == 0


def test_a_training_forward_that_computed_wrong_once_is_named_by_its_measured_value():
    """Where the adapter measures its training forward (DeepSpeed), the owner's value is that measure, not a
    replay: rank 2's training forward was wrong once (its replays are right), and it is the one named."""
    def measured(r, inputs):
        loss, digest = replayer(False)((inputs, None), 0)
        return (torch.tensor(loss * (1.01 if r == 2 else 1.0), dtype=torch.float64), torch.tensor(digest, dtype=torch.float64))
    (v,) = run_world(3, measured=measured)
    assert v.ranks == (2,) and v.detail["suspect"]
    assert run_world(3, measured=lambda r, inputs: tuple(torch.tensor(x, dtype=torch.float64)
                                                            for x in replayer(False)((inputs, None), 0))) == []


def test_a_tolerance_accepts_tiny_differences_and_still_names_a_real_one():
    assert run_world(3, wrong={1}, rtol=0.01) == []       # 1e-3 relative: within 1%
    (v,) = run_world(3, wrong={1}, rtol=1e-6)
    assert v.ranks == (1,)


def test_arbitration_names_a_rank_wrong_only_the_first_time():
    votes = {0: (1.0, 5.0), 1: (1.0, 5.0), 2: (1.0, 5.0)}
    ranks, majority, _ = arbitrate([0, 1, 2], 0, 1, {0: (1.0, 5.0), 1: (1.1, 6.0)}, votes, 0)
    assert ranks == [1] and majority


def test_the_payload_is_plain_and_comes_back_on_the_receivers_device():
    batch = ((torch.arange(6).view(2, 3),), {"labels": torch.ones(2, dtype=torch.long)}, OutputPoison(row=1))
    back = p2p.decode(p2p.encode(batch), torch.device("cpu"))
    assert torch.equal(back[0][0], batch[0][0]) and torch.equal(back[1]["labels"], batch[1]["labels"])
    assert back[2] == OutputPoison(row=1)

    class Mine:  # an object of the user's: not a plain batch, so not sent (the sender decides)
        pass
    assert p2p.encode({"x": Mine()}) == b""
    import pickle
    with pytest.raises(Exception):  # a pickle that would run code is refused by the weights-only load
        p2p.decode(pickle.dumps({"obj": Mine(), "accel": []}), torch.device("cpu"))


def test_a_payload_that_does_not_decode_is_no_payload_and_a_huge_one_is_never_sent(monkeypatch):
    """Issue 35 item 7: one rank's decode error left the others waiting for the collective timeout; a peer's size
    was uncapped. A payload that does not decode is none (every rank goes on to the all-gather); one over the cap is
    not sent; an announced size over it is refused by name, never allocated."""
    import collections
    import pickle

    code = pickle.dumps({"obj": collections.Counter("ab"), "accel": []})  # (not weights-only loadable)
    assert p2p.received(code, torch.device("cpu")) is None
    assert p2p.received(b"\x00garbage", torch.device("cpu")) is None and p2p.received(b"", torch.device("cpu")) is None
    ok = p2p.encode((torch.ones(4),))
    assert torch.equal(p2p.received(ok, torch.device("cpu"))[0], torch.ones(4))
    monkeypatch.setattr(p2p, "MAX_BYTES", len(ok) - 1)
    assert p2p.encode((torch.ones(4),)) == b""
