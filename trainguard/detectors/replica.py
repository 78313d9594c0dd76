"""Replica agreement: silent data corruption of the weights, named by rank.

The ranks of a data-parallel group hold the same parameters, bit for bit (every parameter at ZeRO 0-2 and in
megatron's DDP, the distributed optimizer's model parameters included; not ZeRO-3's partitions). Every
``every_steps`` steps each rank adds a digest of its own parameters to the AGREE table: the sum of their
bits read as integers, modulo 2**52 (exact in the table's float64; a single flipped bit changes it by
+-2**k, never a multiple of 2**52 for k < 52). A rank whose digest differs from its group's is named --
against a strict majority of the group, or, with no majority (2 replicas), every rank of the disagreeing
group -- and the ``replica_mismatch`` ladder acts from before the last check where every group agreed: the
weights read then were the ones after the step before it, so the checkpoints up to that step are clean.
"""
from __future__ import annotations

from collections import Counter, defaultdict

import torch

from trainguard.verdicts import Verdict
from trainguard.detectors.registry import Decide, Registration
from trainguard.ranks.bits import digest
from trainguard.events import Anomaly

class ReplicaCheck:
    name = "replica_check"

    def __init__(self, cfg, device=None):
        self.cfg = cfg
        self.params: list[torch.Tensor] = []
        self.names: list[str] = []
        self.agreed_at = 0  # the last check step at which every replica group agreed (0: none yet)
        self.checks = 0     # check steps compared (run_end's checks_run: a healthy run shows they ran)

    def attach_model(self, model: torch.nn.Module) -> None:
        # (ZeRO-3 partitions its parameters: what a rank holds is its own slice, not a replica)
        named = [(n, p) for n, p in model.named_parameters() if not hasattr(p, "ds_id")]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]

    def sampled(self, step: int) -> bool:
        """A check step: every rank's digest must travel (trainguard.step.agreement gathers the rows then)."""
        return step % self.cfg.every_steps == 0

    def local(self, step: int):
        return digest(self.params) if self.sampled(step) and self.params else None

    def clear(self, step: int, s) -> bool:
        return step % self.cfg.every_steps != 0  # (its check steps are decided before the update)

    def observe(self, step: int, ctx: Decide) -> list[Verdict]:
        coords = ctx.coords
        values = {o.rank: o.extra.get("replica_digest", float("nan")) for o in ctx.rows}
        if step % self.cfg.every_steps or any(v != v for v in values.values()):  # (NaN: not a check step)
            return []
        self.checks += 1
        groups: dict[tuple, list[int]] = defaultdict(list)
        for r in values:
            c = coords[r] if r < len(coords) else None
            groups[(c.tp, c.pp, c.cp, c.ep) if c is not None else ()].append(r)
        verdicts = []
        for ranks in groups.values():
            counts = Counter(values[r] for r in ranks)
            if len(counts) < 2:
                continue
            value, n = counts.most_common(1)[0]
            majority = n * 2 > len(ranks)
            named = [r for r in ranks if values[r] != value] if majority else list(ranks)
            verdicts.append(Verdict(detector=self.name, anomaly=Anomaly.REPLICA_MISMATCH, ranks=tuple(named), detail={
                "digests": {str(r): int(values[r]) for r in ranks}, "majority": majority, "group": list(ranks),
                "agreed_at": self.agreed_at, "onset_step": max(self.agreed_at, 1),
                "every_steps": self.cfg.every_steps,
                # (outvoted by its replicas: this rank's memory or device holds bits the others do not)
                "suspect": "weights differ from the majority of its replicas" if majority else None}))
        if not verdicts:
            self.agreed_at = step
        return verdicts

    def explain(self, step: int, found: list[Verdict], group=None) -> None:
        """On a mismatch step only (every rank, after observe): which tensors differ. One object gather of every
        rank's per-tensor digests; each named rank's verdict gets the tensors whose digest differs from the
        majority of its group (or, with no majority, from the other replica's), at most 16 of them."""
        from trainguard.ranks.isolation import gather_objects

        mine = [int(digest([p])) for p in self.params]
        everyone = gather_objects(mine, group)
        for v in found:
            ranks = v.detail["group"]
            tensors = {}
            for r in v.ranks:
                others = [q for q in ranks if q != r and q not in v.ranks] or [q for q in ranks if q != r]
                differ = [self.names[i] for i in range(len(self.names))
                          if i < len(everyone[r]) and all(i < len(everyone[q]) and everyone[q][i] != everyone[r][i]
                                                          for q in others)]
                tensors[str(r)] = differ[:16] + ([f"... {len(differ) - 16} more"] if len(differ) > 16 else [])
            v.detail["tensors"] = tensors

    def state_dict(self) -> dict:
        return {"agreed_at": self.agreed_at}

    def load_state_dict(self, state: dict) -> None:
        self.agreed_at = int(state.get("agreed_at", 0))


REGISTRATION = Registration(key="replica_check", build=ReplicaCheck, column="replica_digest")
