"""Attribution: from every rank's gathered values to the culprit ranks and their samples.

Pure functions over the object gather the guard takes on anomaly steps (``everyone``: ``{rank: its dict}`` with
``sample_ids``, ``position``, ``localized``, ... -- every rank's, or at scale the named ranks'; trainguard.step.agreement)
and the ranks' coordinates.
"""
from __future__ import annotations

import math
from typing import Sequence

from trainguard.verdicts import Verdict
from trainguard.events import Action
from trainguard.ranks.isolation import RankCoords


def argmax(values: Sequence[float | None]) -> int:
    """The index of the largest finite value (0 when there is none)."""
    best, arg = -math.inf, 0
    for i, v in enumerate(values):
        if v is not None and math.isfinite(v) and v > best:
            best, arg = v, i
    return arg


def culprit_samples(decision, everyone: dict[int, dict] | None) -> dict[int, list[int]]:
    """Dirty-data isolation: the samples of the culprit ranks only (another rank's batch was
    fine, even though the all-reduce would have carried the damage to it)."""
    from trainguard.decisions import DATA_OR_WEIGHTS, anomaly_class

    if decision.action not in (Action.SKIP_STEP, Action.ROLLBACK) or not everyone:
        return {}
    ranks = {r for v in decision.verdicts if anomaly_class(v) in DATA_OR_WEIGHTS for r in v.ranks}
    # a per-sample replay (trainguard.replay.replay) narrowed a rank's batch to the samples to blame
    return {r: list((everyone[r].get("narrowed") or {}).get("ids") or everyone[r]["sample_ids"])
            for r in sorted(ranks) if r in everyone}


def narrow_to_origin(v: Verdict, everyone: dict[int, dict], coords: Sequence[RankCoords]) -> Verdict:
    """Non-finite values spread inside a model-parallel group (the ranks that share a data-parallel
    index): down the pipeline in the forward (stage 0's NaN is stage 1's NaN loss), back up it in
    the backward (stage 1's NaN loss is stage 0's NaN gradients), and across a tensor-parallel
    group through its all-reduces. Within each such group the origin is, in this order: the rank(s)
    whose first non-finite module came earliest (localisations with an ``origin_order``: pipeline stage,
    then position in the forward), else the rank(s) whose loss was non-finite, else all. Others are
    listed as ``affected_ranks``. Data-parallel replicas never share values before the check, so
    each group is judged alone (with pure data parallelism every rank is its own group)."""
    def dp_of(r: int) -> int:
        return coords[r].dp if r < len(coords) else r

    per_rank = v.detail.get("per_rank", {})
    groups: dict[int, list[int]] = {}
    for r in v.ranks:
        groups.setdefault(dp_of(r), []).append(r)
    origin: list[int] = []
    for members in groups.values():
        orders = {}
        for r in members:
            loc = everyone.get(r, {}).get("localized")
            if loc and loc.get("origin_order") is not None:
                orders[r] = tuple(loc["origin_order"])
        if orders:
            first = min(orders.values())
            origin += [r for r in members if orders.get(r) == first]
            continue
        lossy = [r for r in members if per_rank.get(r, {}).get("origin") == "loss"]
        origin += lossy or members
    origin_t = tuple(sorted(origin))
    if origin_t == v.ranks:
        return v
    return Verdict(v.detector, v.anomaly, origin_t, {**v.detail,
                                                     "per_rank": {r: d for r, d in per_rank.items() if r in origin_t},
                                                     "affected_ranks": list(v.ranks)})


def merge_nonfinite(a: Verdict | None, b: Verdict) -> Verdict:
    if a is None:
        return Verdict("nonfinite", "nonfinite", b.ranks, b.detail)
    per_rank = dict(a.detail.get("per_rank", {}))
    for r, d in b.detail.get("per_rank", {}).items():
        per_rank[r] = {**d, **per_rank.get(r, {})}
    return Verdict(a.detector, a.anomaly, tuple(sorted(set(a.ranks) | set(b.ranks))), {**a.detail, "per_rank": per_rank})


def by_rank(everyone: dict[int, dict] | None, key: str) -> dict[int, dict]:
    """``{rank: its sampled values}`` from the gathered objects (ranks that sampled nothing left out)."""
    return {r: e[key] for r, e in (everyone or {}).items() if e.get(key)}
