"""Which attempt of the job this process belongs to: 0 for the first; torchrun's restarts within an allocation
(``TORCHELASTIC_RESTART_COUNT``) plus the scheduler's requeues of the job (``SLURM_RESTART_COUNT``). Within an
attempt, :func:`generation` counts the worlds formed again after a rank was replaced in the same job
(trainguard.liveness.world); a process fault fires in the first only, like a restarted attempt's spare getting past it. A restarted
attempt resumes (trainguard.checkpoint.manager), writes the ``restart`` record (trainguard.liveness.watchdog), and
faults meant for one attempt fire only in it (trainguard.faults)."""
from __future__ import annotations

import os

SOURCES = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")


def restart_attempt() -> int:
    total = 0
    for name in SOURCES:
        try:
            total += max(0, int(os.environ.get(name, "0") or 0))
        except ValueError:
            continue
    return total


def generation() -> int:
    """The world's generation in a supervised job (trainguard.liveness.world): 0 until a rank was replaced."""
    try:
        return max(0, int(os.environ.get("TRAINGUARD_GENERATION", "0") or 0))
    except ValueError:
        return 0
