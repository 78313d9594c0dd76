"""Which attempt of the job this process belongs to: 0 for the first; torchrun's restarts within an allocation
(``TORCHELASTIC_RESTART_COUNT``) plus the scheduler's requeues of the job (``SLURM_RESTART_COUNT``) plus the
world formed again in the same job after a rank died (``TRAINGUARD_GENERATION``, trainguard.world). A restarted
attempt resumes (trainguard.checkpoint.manager), writes the ``restart`` record (trainguard.watchdog), and
faults meant for one attempt fire only in it (trainguard.faults)."""
from __future__ import annotations

import os

SOURCES = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT", "TRAINGUARD_GENERATION")  # (the last: a rank
# replaced in the same job, trainguard.world)


def restart_attempt() -> int:
    total = 0
    for name in SOURCES:
        try:
            total += max(0, int(os.environ.get(name, "0") or 0))
        except ValueError:
            continue
    return total
