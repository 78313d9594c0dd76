"""The in-memory snapshot tier's megatron part (trainguard/checkpoint/memory_tier.py is the tier itself).

A snapshot is this rank's own state, taken without a collective -- dist_checkpointing's save is one (it
plans the shards across ranks), so the tier does not use it: each model chunk's local ``state_dict()``
(this rank's tensor- and pipeline-parallel slices), each inner torch optimizer's ``state_dict()`` and the
values of the parameters it steps (megatron's fp32 main parameters; with the distributed optimizer this
rank's shard of them), megatron's grad scaler, and trainguard's sidecar (every RNG, megatron's
tensor-parallel RNG tracker, the iteration, the loop's data state). A shard loads on the rank that wrote
it (or, after its node was lost, on the rank that takes its place), at the same TP/PP/DP layout.
"""
from __future__ import annotations

from pathlib import Path

import torch

from megatron_hooks.parts import _optimizers, _unwrap
from trainguard.ports import host_copy, load_weights, rank as _rank

__all__ = ["MegatronShard", "SHARD"]

SHARD = "shard"          # the folder of a tag holding rank<r>.pt, this rank's state
OWN_STATE_LAYOUT = ("world", "tp", "pp", "dp", "ep", "chunks", "distributed_optimizer")  # (where it loads)


def _inner(optimizer) -> list:
    return [getattr(o, "optimizer", o) for o in _optimizers(optimizer)]


def _first_replica(now: dict) -> int:
    """The first of this rank's data-parallel replicas (gtp peers hold other shards); itself under expert parallel."""
    from megatron.core import parallel_state as ps

    if now["ep"] != 1 or getattr(ps, "get_expert_tensor_parallel_world_size", lambda: None)() not in (None, now["tp"]):
        return _rank()
    own = ps.get_data_parallel_group  # (megatron-core 0.19's default group spans gtp_remat: left out)
    group = own(**({"with_gtp_remat": False} if "with_gtp_remat" in own.__code__.co_varnames else {}))
    return torch.distributed.get_process_group_ranks(group)[0]


class MegatronShard:
    """trainguard.checkpoint.memory_tier.ShardSource over megatron-core model chunks and optimizer. ``once``: what
    data-parallel replicas share (the weights; a non-distributed optimizer) written by the first of them only."""

    def __init__(self, ms, once: bool = False):
        self.ms = ms  # megatron_hooks.checkpoint.MegatronState
        self.first = _first_replica(ms.layout()) if once else _rank()  # (whose file holds what the replicas share)

    def unsupported(self) -> str | None:
        return None

    def estimated_bytes(self) -> int:  # (what this rank copies: a replica's part under ``once``, none or its shard)
        mg, mine = self.ms.mg, self.first == _rank()
        model = sum(p.numel() * p.element_size() for c in mg.chunks for p in c.parameters()) if mine else 0
        stepped = sum(p.numel() for o in _inner(mg.optimizer) for g in o.param_groups for p in g["params"])
        return int(model + stepped * 4 * 3 * (mine or self.ms.layout()["distributed_optimizer"]))

    def step(self) -> int:
        return self.ms.mg.iteration

    def fits(self) -> dict:
        """One rank's model chunks, TP/PP/EP slices and data-parallel shard: it loads at the same layout only (a
        restart at another one takes the disk snapshots, which dist_checkpointing reshards)."""
        now = self.ms.layout()
        return {k: now[k] for k in OWN_STATE_LAYOUT}

    def state(self) -> dict | None:
        """This rank's state (live tensors: the caller copies them); the replicas' shared part only from ``first``."""
        mg, mine = self.ms.mg, self.first == _rank()
        if not (mine or self.ms.layout()["distributed_optimizer"]):
            return None
        optimizers = []
        for outer, inner in zip(_optimizers(mg.optimizer), _inner(mg.optimizer)):
            scaler = getattr(outer, "grad_scaler", None)
            optimizers.append({"inner": inner.state_dict(),
                               "values": [p.detach() for g in inner.param_groups for p in g["params"]],
                               "grad_scaler": scaler.state_dict() if scaler is not None else None})
        return {"model": [_unwrap(c).state_dict() for c in mg.chunks] if mine else None, "optimizers": optimizers}

    def capture(self, staging_root: Path, tag: str, step: int) -> list:
        state = self.state()
        return [] if state is None else [(host_copy(state), staging_root / tag / SHARD / f"rank{_rank()}.pt")]

    def read_bytes(self, reader) -> int:  # (what :meth:`load` reads: this rank's file and the first replica's)
        return sum(int(reader.files.get(f"{SHARD}/rank{r}.pt", {}).get("size", 0)) for r in {_rank(), self.first})

    def load(self, reader, tag_dir: Path) -> None:
        """Put this rank's shard of ``tag_dir`` back (bytes checked by ``reader`` against the manifest first)."""
        mg, me = self.ms.mg, _rank()
        own = load_weights(reader, tag_dir / SHARD / f"rank{me}.pt") \
            if self.first == me or f"{SHARD}/rank{me}.pt" in reader.files else None  # (a replica's: none, or its part)
        first = own if self.first == me else load_weights(reader, tag_dir / SHARD / f"rank{self.first}.pt")
        state = {"model": first["model"], "optimizers": (own or first)["optimizers"]}
        if len(state["model"]) != len(mg.chunks) or len(state["optimizers"]) != len(_inner(mg.optimizer)):
            raise ValueError(f"{tag_dir}: rank {_rank()}'s shard holds {len(state['model'])} model chunk(s) and "
                             f"{len(state['optimizers'])} optimizer(s), this run {len(mg.chunks)} and "
                             f"{len(_inner(mg.optimizer))}: it loads only at the layout it was written at")
        for chunk, sd in zip(mg.chunks, state["model"]):
            _unwrap(chunk).load_state_dict(sd)
        for outer, inner, saved in zip(_optimizers(mg.optimizer), _inner(mg.optimizer), state["optimizers"]):
            params = [p for g in inner.param_groups for p in g["params"]]
            with torch.no_grad():
                for p, v in zip(params, saved["values"]):
                    p.copy_(v)
            inner.load_state_dict(saved["inner"])
            scaler = getattr(outer, "grad_scaler", None)
            if scaler is not None and saved["grad_scaler"] is not None:
                scaler.load_state_dict(saved["grad_scaler"])
