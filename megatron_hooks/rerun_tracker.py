"""Megatron-LM's "result rejected" tracker file (``--result-rejected-tracker-filename``), written when
trainguard names a rank's non-finite iteration, so that Megatron-LM's own machinery skips it on a
later run. Megatron-LM's rerun state machine appends one line per rejected result and, at argument validation,
reads the file back (``RerunStateMachine.get_skipped_iterations_from_tracker_file``): an iteration
rejected twice on the same rank, by one rank only, goes into ``--iterations-to-skip`` and is skipped
(its data fast-forwarded) when the job reruns it. trainguard took over the NaN check that wrote those
lines (megatron_hooks.lm's handover), so it writes them itself, in Megatron-LM's format: one line per
named rank and iteration, status ``RERUN_DISABLED`` (trainguard does not rerun the step on another
GPU: a skipped iteration that fails again on the same rank after a rollback or a restart is one that
Megatron-LM then skips). Rank 0 writes (a mirror of the run's records): no concurrent appends.
"""
from __future__ import annotations

import datetime
import os

from trainguard.ports import open_append
from trainguard.events import Record

__all__ = ["RerunTracker"]

STATUS = "RerunValidationStatus.RERUN_DISABLED"  # (how Megatron-LM's own str-Enum prints in these lines)


class RerunTracker:
    def __init__(self, path: str, coords) -> None:
        self.path = path
        self.coords = {c.rank: c for c in coords}

    def line(self, step: int, rank: int, detail: dict) -> str:
        c = self.coords.get(rank)
        named = (detail.get("per_rank") or {}).get(str(rank)) or {}
        where = named.get("first_nonfinite_module") or named.get("anomaly") or "loss or gradients"
        samples = named.get("sample_ids") or []
        # (Megatron-LM's own reader matches "... rank=R iteration=I status=S result=... message=...")
        message = f"trainguard: non-finite at {where}; samples {samples[:16]}".replace("'", "")
        return (f"ts={datetime.datetime.now()} node={c.host if c else 'unknown'} device={c.local_rank if c else 0} "
                f"jobID={os.getenv('SLURM_JOBID', 'N/A')} rank={rank} iteration={step} status={STATUS} "
                f"result=nan message='{message}'\n")

    def event(self, step: int, record: str, ranks, action, detail) -> None:
        if record != Record.NONFINITE.value or not ranks:
            return
        try:
            with open_append(self.path) as f:  # (never through a link planted in the log folder)
                for rank in ranks:
                    f.write(self.line(step, int(rank), detail or {}))
        except OSError:  # (Megatron-LM's own writer logs and goes on too: the tracker is advice, never fatal)
            pass

    def metric(self, step: int, line: dict) -> None:
        pass

    def close(self) -> None:
        pass
