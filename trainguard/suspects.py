"""Suspect ranks: a rank that is the culprit again and again, on different data, is suspect
hardware. Rank 0 keeps ``suspect_hosts.json`` beside the event log: what a launcher excludes on
restart (scripts/launch/slurm_deepspeed.sbatch reads it)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from trainguard.events import Record

ADVICE = ("the same rank produced anomalies on different data: suspect its GPU or host; a restart can exclude "
          "the host (scripts/launch/slurm_deepspeed.sbatch reads the file)")


class SuspectWatch:
    def __init__(self, suspect_after: int, rank: int, jsonl: str | None, coords_of: Callable[[int], dict],
                 world: int = 0):
        self.suspect_after = suspect_after
        self.rank = rank
        self.world = world
        self.jsonl = jsonl
        self.coords_of = coords_of
        self.seen: dict[int, list] = {}    # rank -> [(step, sample ids)] it was the culprit
        self.suspected: set[int] = set()

    def observe(self, step: int, culprits: dict[int, list[int]], emit) -> None:
        """``culprits``: this step's culprit ranks and their samples. ``emit``: EventLog.emit.

        A step on which every data-parallel replica held a culprit is no evidence against any one of them: a numerics failure they
        all share (an LR too high, an fp16 scale collapsing on every rank) -- counted, it named every rank suspect
        and sent every host to suspect_hosts.json, which a launcher excludes and drains (issue 33)."""
        if self.world > 1 and culprits:
            # (by data-parallel replica: under tensor/pipeline parallelism one origin per model-parallel group is named)
            replicas = {self.coords_of(r).get("dp", r) for r in range(self.world)}
            if len(replicas) > 1 and {self.coords_of(r).get("dp", r) for r in culprits} >= replicas:
                return
        for r, ids in culprits.items():
            seen = self.seen.setdefault(r, [])
            if not any(set(ids) == set(prev) for _, prev in seen):
                seen.append((step, ids))
            if len(seen) >= self.suspect_after:
                self.suspect(step, r, None, emit, occurrences=[s for s, _ in seen])

    def suspect(self, step: int, r: int, why: str | None, emit, occurrences: list[int] | None = None) -> None:
        """Name rank ``r`` suspect, once: the record, and its host in the file. ``why``: a reason other than
        anomalies on different data (a persistent straggler)."""
        if r in self.suspected:
            return
        self.suspected.add(r)
        coords = self.coords_of(r)
        emit(step, Record.SUSPECT_RANK, [r], "alert", {
            "coords": coords, "host": coords.get("host"), "occurrences": occurrences or [step],
            **({"why": why} if why else {}), "file": self._write(), "advice": ADVICE})

    def _write(self) -> str | None:
        if self.rank != 0 or not self.jsonl:
            return None
        from trainguard.checkpoint.fsio import atomic_write_json

        path = Path(self.jsonl).with_name("suspect_hosts.json")
        ranks = sorted(self.suspected)
        atomic_write_json(path, {"ranks": ranks, "hosts": sorted({str(self.coords_of(r).get("host")) for r in ranks}),
                                 "coords": [self.coords_of(r) for r in ranks]})
        return str(path)
