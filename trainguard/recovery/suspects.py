"""Suspect ranks: a rank that is the culprit again and again, on different data, is suspect
hardware. Rank 0 keeps ``suspect_hosts.json`` beside the event log: what a launcher excludes on
restart (scripts/launch/slurm_deepspeed.sbatch reads it)."""
from __future__ import annotations

import os

from pathlib import Path
from typing import Callable

from trainguard.events import Record

ADVICE = ("the same rank produced anomalies on different data: suspect its GPU or host; a restart can exclude "
          "the host (scripts/launch/slurm_deepspeed.sbatch reads the file)")


QUIET_STEPS = 20  # a culprit counts against its rank only when the other replicas were healthy this long before


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
        self.last_failure: dict = {}       # data-parallel replica -> the last step it held a culprit
        self.replicas: int | None = None   # how many data-parallel replicas the world has
        self.dp_of: list[int] | None = None

    def observe(self, step: int, culprits: dict[int, list[int]], emit, failing=(), data_blamed: bool = False) -> None:
        """``culprits``: this step's culprit ranks and their samples. ``emit``: EventLog.emit.

        A rank's anomalies count against it only while they are its own: a step on which every
        data-parallel replica held a culprit is no evidence against any one of them, and a culprit on another
        replica voids the occurrences before it -- a numerics failure the run shares (an LR too high, an fp16
        scale collapsing) strikes the ranks in turn, on different steps; counted, it named every rank suspect and
        sent every host to suspect_hosts.json, which a launcher excludes and drains. Hardware is a rank that
        fails again and again while the other replicas stay healthy. ``failing``: the ranks whose own values were not
        healthy this step beside the culprits (a loss spike names the rank with the highest loss; a stretch of bad
        data reaches every rank). ``data_blamed``: the replay blamed the data (the last healthy micro-batch replayed
        healthy on these weights) -- no evidence against a host. Nor is a culprit where every rank reads the same batch (one data-parallel replica:
        TP/PP alone, or one process): nothing to compare it with -- a Slurm script reading the file drains a healthy
        node."""
        if not culprits and not failing or data_blamed:
            return  # (a healthy step: nothing to count, and nothing here may cost more in a bigger world)
        if self.world <= 1 or self.replicas == 1:
            return
        if self.world > 1:
            # (by data-parallel replica: under tensor/pipeline parallelism one origin per model-parallel group is named)
            if self.replicas is None:  # (known at BEGIN from the coordinates: see :meth:`begin`)
                self.replicas = len({self._replica(r) for r in range(self.world)})
            failing = {self._replica(r) for r in [*culprits, *failing]}
            for rep in failing:
                self.last_failure[rep] = step
            if not culprits or (self.replicas > 1 and len(failing) >= self.replicas):
                return
        for r, ids in culprits.items():
            others = [s for rep, s in self.last_failure.items() if rep != self._replica(r)]
            since = max(others) if others else None
            seen = [(s, prev) for s, prev in self.seen.get(r, []) if since is None or s >= since]
            if since is not None and step - since <= QUIET_STEPS:
                pass  # another replica failed just before (or on this very step): shared, no evidence
            elif not any(set(ids) == set(prev) for _, prev in seen):
                seen.append((step, ids))
            self.seen[r] = seen
            if len(seen) >= self.suspect_after:
                self.suspect(step, r, None, emit, occurrences=[s for s, _ in seen])

    def rewound(self, to_step: int) -> None:
        """The step counter went back to ``to_step`` (a rollback): a shared failure recorded after it would otherwise
        lie in the future of every step until the run passed it again."""
        self.last_failure = {rep: min(s, to_step) for rep, s in self.last_failure.items()}

    def _replica(self, r: int):
        if self.dp_of is not None:
            return self.dp_of[r] if r < len(self.dp_of) else r
        return self.coords_of(r).get("dp", r)

    def begin(self, coords) -> None:
        """Every rank's coordinates (trainguard.ranks.isolation.RankCoords), once: each rank's data-parallel replica."""
        self.dp_of = [c.dp for c in coords]
        self.replicas = len(set(self.dp_of)) if self.dp_of else None

    def suspect(self, step: int, r: int, why: str | None, emit, occurrences: list[int] | None = None) -> None:
        """Name rank ``r`` suspect, once: the record, and its host in the file. ``why``: a reason other than
        anomalies on different data (a persistent straggler)."""
        if r in self.suspected:
            return
        self.suspected.add(r)
        coords = self.coords_of(r)
        emit(step, Record.SUSPECT_RANK, [r], "alert", {
            "coords": coords, "host": coords.get("host"), "occurrences": occurrences or [step],
            **({"why": why} if why else {}), **self._write(), "advice": ADVICE})

    def _write(self) -> dict:
        """``{"file": the suspect file}`` (rank 0; None elsewhere), or why it could not be written -- a planted
        folder or a file not ours in the log folder is the file's failure, never the run's."""
        if self.rank != 0 or not self.jsonl:
            return {"file": None}
        from trainguard.checkpoint.fsio import atomic_write_json

        path = Path(self.jsonl).with_name("suspect_hosts.json")
        ranks = sorted(self.suspected)
        # (the job's id: a launcher acts on a file of its own job only -- a previous job's, or one anyone else wrote
        # into the log folder, excludes and drains nothing: scripts/launch/slurm_requeue.sh)
        try:
            atomic_write_json(path, {"job_id": os.environ.get("SLURM_JOB_ID"), "ranks": ranks,
                                     "hosts": sorted({str(self.coords_of(r).get("host")) for r in ranks}),
                                     "coords": [self.coords_of(r) for r in ranks]}, mode=0o600)  # (the job's own)
        except OSError as e:
            return {"file": None, "file_error": f"{path}: {e}: not written (nothing drains or excludes the host)"}
        return {"file": str(path)}
