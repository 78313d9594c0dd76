"""Peer replay: silent data corruption in the compute, named by rank.

The replicas of a data-parallel group hold the same weights (the replica check makes sure), so the same
micro-batch must give the same loss and the same outputs on any of them. Every ``every_steps`` steps each rank
sends its last micro-batch of the step -- its inputs (token ids), never activations, and the random-number state
its training forward started from -- to the next replica of its group (:mod:`trainguard.replay.p2p`), which replays it
forward-only on the current weights from that state. The owner's own value is what its training forward computed
(DeepSpeed measures it on the device as it happens), or, where the adapter cannot reproduce a training forward
(megatron's forward-only schedule runs in eval mode), its own replay made the same way as the peer's. One small
all-gather of four numbers per rank (own loss and output digest, its replay of its predecessor's) lets every rank
compare every pair alike.

A pair that differs is arbitrated: every replica of the group replays that micro-batch, and the rank outvoted by
a strict majority is named (``compute_mismatch``, its host suspect); with 2 replicas there is no third to tell,
and both are named. A device that computes wrong does so in the replays of its step as in its training forward
(the ``sdc_compute`` fault stands for it): its own replay and its replay of its predecessor's micro-batch both
come out apart.

On a non-finite or burst step that neither the data nor the weights explain (recovery.replay_check: the weights
replay healthy, and no sample is to blame), the culprit's micro-batch is replayed the same way: when it replays
healthy on the culprit and its peer alike, the culprit's training forward computed what neither reproduces, and
it is named. Every decision is made from gathered values, so every rank reaches the same one; the replays run in
the same order on every rank of a model-parallel group (their forwards are collective).

Compared: bit for bit (``rtol`` 0: deterministic kernels, the same on every replica) or the losses within
``rtol``. Not seen: on megatron (the owner's value is its own replay), an error in the training forward alone, gone
by the replay a moment later, unless it made a spike; which member of a model-parallel group computes wrong (the group's loss is one value: every member of the
replica's group is named).
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Sequence

import torch

from trainguard.replay import p2p
from trainguard.verdicts import PeerContext, Verdict
from trainguard.detectors.registry import Decide, Registration
from trainguard.events import Anomaly

NAN = float("nan")
Value = tuple  # (loss, digest): floats, NaN where there is none


def replica_groups(coords: Sequence) -> list[list[int]]:
    """The data-parallel replica groups: ranks with the same tensor/pipeline/context/expert coordinates, each in
    data-parallel order."""
    groups: dict[tuple, list] = defaultdict(list)
    for c in coords:
        groups[(c.tp, c.pp, c.cp, c.ep)].append(c)
    return [[c.rank for c in sorted(g, key=lambda c: (c.dp, c.rank))] for _, g in sorted(groups.items())]


def same(a: Value, b: Value, rtol: float) -> bool | None:
    """Whether two replays agree; None when they cannot be compared (one of them did not run)."""
    (la, da), (lb, db) = a, b
    if all(x != x for x in (la, da)) or all(x != x for x in (lb, db)):
        return None
    if rtol > 0:
        if la != la or lb != lb:
            return None if (la != la) and (lb != lb) else False
        if not (math.isfinite(la) and math.isfinite(lb)):
            return (la == lb) or (not math.isfinite(la) and not math.isfinite(lb))
        return abs(la - lb) <= rtol * max(abs(la), abs(lb))
    return _bits(la) == _bits(lb) and _bits(da) == _bits(db)


def _bits(x: float):
    return "nan" if x != x else x


def pairs(groups: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """(owner, replayer) of every micro-batch: each rank's is replayed by the next replica of its group."""
    return [(g[i], g[(i + 1) % len(g)]) for g in groups if len(g) > 1 for i in range(len(g))]


def disputes(groups, own: dict[int, Value], peer: dict[int, Value], rtol: float) -> list[tuple[int, int]]:
    """The (owner, replayer) pairs whose replays of the owner's micro-batch differ."""
    return [(o, p) for o, p in pairs(groups) if same(own[o], peer[p], rtol) is False]


def arbitrate(group: Sequence[int], owner: int, replayer: int, first: dict[int, Value],
              votes: dict[int, Value], rtol: float) -> tuple[list[int], bool, dict]:
    """Every replica's replay of ``owner``'s micro-batch (``votes``) and the first two (``first``: the owner's own
    and its replayer's) -> (the ranks named, whether a strict majority decided, its value)."""
    clusters: list[list[int]] = []
    for r in group:
        if same(votes[r], votes[r], rtol) is None:
            continue
        for c in clusters:
            if same(votes[c[0]], votes[r], rtol):
                c.append(r)
                break
        else:
            clusters.append([r])
    best = max(clusters, key=len) if clusters else []
    if best and len(best) * 2 > len(group):
        value = votes[best[0]]
        named = {r for r in group if r not in best}
        named |= {r for r, v in first.items() if same(v, value, rtol) is False}  # (wrong the first time only)
        return sorted(named), True, {"loss": value[0], "digest": value[1]}
    return sorted({owner, replayer}), False, {}


class PeerReplay:
    name = "peer_replay"

    def __init__(self, cfg, device=None):
        self.cfg = cfg
        self.found: list[Verdict] = []
        self.checks = 0      # sampled or spike steps replayed (for the record)
        self.last_checked = 0
        self.transport = Transport()

    def attach_model(self, model) -> None:
        pass

    def sampled(self, step: int) -> bool:
        return step % self.cfg.every_steps == 0

    def clear(self, step: int, s) -> bool:
        return not self.sampled(step)  # (a replay on a spike's step: one step late, as the spike's other verdicts)

    def local(self, step: int):
        return None

    # ------------------------------------------------------------------ at DECIDE, every rank
    def exchange(self, step: int, ctx: PeerContext) -> None:
        """The replays and their exchange on a due step (collective: every rank calls it at every DECIDE)."""
        self.found = []
        unexplained = tuple(ctx.unexplained) if self.cfg.on_spike else ()
        if step % self.cfg.every_steps and not unexplained:
            return
        groups = [g for g in replica_groups(ctx.coords) if len(g) > 1]
        if not groups:
            return
        self.checks += 1
        self.last_checked = step
        mine = next((g for g in groups if ctx.rank in g), None)
        batch = ctx.batch
        mine_in = (batch.inputs, batch.rng) if batch is not None else None
        payload = p2p.encode(mine_in) if mine_in is not None else b""
        sends, receives, pred = {}, [], None
        if mine is not None:
            i = mine.index(ctx.rank)
            pred, succ = mine[i - 1], mine[(i + 1) % len(mine)]
            sends, receives = {succ: payload}, [pred]
        got = self.transport.exchange(sends, receives, ctx.device, ctx.group)
        # the owner's own: what its training forward computed (with the RNG state its peer replays from), where the
        # adapter measured it; else its own replay, made the same way as its peer's (megatron: eval mode)
        own = _measured(batch.value) if payload and batch.value is not None else \
            self._replay(ctx, mine_in if payload else None, step)
        theirs = self._replay(ctx, p2p.received(got.get(pred), ctx.device), step)
        table = self.transport.all_gather([*own, *theirs], ctx.device, ctx.group)
        own_of = {r: (row[0], row[1]) for r, row in enumerate(table)}
        peer_of = {r: (row[2], row[3]) for r, row in enumerate(table)}
        rtol = self.cfg.rtol
        found = disputes(groups, own_of, peer_of, rtol)
        named: dict[int, list] = {}
        if found:
            self._arbitrate(step, ctx, groups, found, own_of, peer_of, payload, named)
        for c in unexplained:  # (a spike's culprit whose micro-batch replays healthy on two devices)
            g = next((g for g in groups if c in g), None)
            if g is None or any(o == c for o, _ in found):
                continue
            p = g[(g.index(c) + 1) % len(g)]
            loss = own_of[c][0]
            if same(own_of[c], peer_of[p], rtol) and loss == loss and ctx.healthy(loss):
                named.setdefault(c, []).append({
                    "why": "its training forward computed a loss that its own replay and its peer's do not reproduce",
                    "owner": c, "replayer": p, "step_loss": _num(ctx.step_loss.get(c)),
                    "replayed_loss": _num(loss), "group": list(g), "majority": True})
        if named:
            suspect = all(e["majority"] for evid in named.values() for e in evid)
            self.found = [Verdict(detector=self.name, anomaly=Anomaly.COMPUTE_MISMATCH, ranks=tuple(sorted(named)),
                                  detail={"evidence": {str(r): e for r, e in sorted(named.items())},
                                          "sampled": step % self.cfg.every_steps == 0, "rtol": rtol,
                                          "onset_step": step,
                                          "suspect": "computes differently from its replicas on the same micro-batch "
                                                     "and weights" if suspect else None})]

    def _arbitrate(self, step, ctx, groups, found, own_of, peer_of, payload, named) -> None:
        """Every replica of a disputed micro-batch's group replays it; the majority names the odd rank out."""
        dps = sorted({ctx.coords[o].dp for o, _ in found})  # (by replica index: model-parallel groups in lockstep)
        mine = next((g for g in groups if ctx.rank in g), [])
        by_dp = {ctx.coords[r].dp: r for r in mine}
        me = ctx.coords[ctx.rank].dp
        sends = {r: payload for r in mine if r != ctx.rank} if me in dps else {}
        receives = [by_dp[d] for d in dps if d in by_dp and by_dp[d] != ctx.rank]
        got = self.transport.exchange(sends, receives, ctx.device, ctx.group)
        row: list[float] = []
        mine_in = (ctx.batch.inputs, ctx.batch.rng) if payload else None
        for d in dps:
            owner = by_dp.get(d)
            inputs = mine_in if owner == ctx.rank else p2p.received(got.get(owner) if owner is not None else None,
                                                                    ctx.device)
            row += self._replay(ctx, inputs, step)
        table = self.transport.all_gather(row, ctx.device, ctx.group)
        for o, p in found:
            g = next(g for g in groups if o in g)
            k = dps.index(ctx.coords[o].dp)
            votes = {r: (table[r][2 * k], table[r][2 * k + 1]) for r in g}
            ranks, majority, value = arbitrate(g, o, p, {o: own_of[o], p: peer_of[p]}, votes, self.cfg.rtol)
            for r in ranks:
                named.setdefault(r, []).append({
                    "why": "outvoted by its replicas' replays of the same micro-batch" if majority else
                    "two replicas disagree and there is no third to tell which computes wrong",
                    "owner": o, "replayer": p, "group": list(g), "majority": majority,
                    "replays": {str(v): _num(votes[v][0]) for v in g},
                    "digests": {str(v): _num(votes[v][1]) for v in g},
                    "first": {"own": _num(own_of[o][0]), "peer": _num(peer_of[p][0])},
                    "agreed": {k2: _num(v) for k2, v in value.items()}})

    def _replay(self, ctx: PeerContext, inputs, step: int) -> list[float]:
        if inputs is None:
            return [NAN, NAN]
        loss, digest = ctx.replay(inputs, step)
        return [NAN if loss is None else float(loss), NAN if digest is None else float(digest)]

    def observe(self, step: int, ctx: Decide) -> list[Verdict]:
        """The verdicts of this step's exchange -- none where the replica check found the named ranks' replicas
        holding different weights in this very table (then their outputs differ for that reason, and
        replica_mismatch names it)."""
        found, self.found = self.found, []
        digests = {o.rank: o.extra.get("replica_digest", float("nan")) for o in ctx.rows} if found else {}
        apart = set()
        for g in replica_groups(ctx.coords) if found else ():
            values = {d for d in (digests.get(r, NAN) for r in g) if d == d}
            if len(values) > 1:
                apart.update(g)
        return [v for v in found if not apart.intersection(v.ranks)]

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def _measured(value) -> list[float]:
    """An adapter's (loss, digest) of a training forward, device values or None, as host floats (a sampled step's
    one read)."""
    return [NAN if v is None else float(v) for v in value]


def _num(x):
    """A value for the log: a non-finite one as text (the JSONL writer would turn it into null)."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else str(x)


class Transport:
    """How the replays travel: micro-batches point to point (trainguard.replay.p2p), the replayed values in one small
    all-gather (a stand-in in the unit tests)."""

    def exchange(self, sends: dict[int, bytes], receives, device, group) -> dict[int, bytes]:
        return p2p.exchange(sends, receives, device, group)

    def all_gather(self, row: list[float], device, group) -> list[list[float]]:
        import torch.distributed as dist

        mine = torch.tensor(row, dtype=torch.float64, device=device)
        out = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, mine, group=group)
        return [t.tolist() for t in out]


REGISTRATION = Registration(key="peer_replay", build=PeerReplay)
