"""How far to lower the LR after a climb it caused: sized by what the LR did, not one fixed factor.

A fixed ``recovery.lr_factor`` (0.5) needs five rungs -- five rollbacks, each re-training the steps it undid --
to bring an LR 30x too high back to sane (bench/natural: the runs ended 24-49% above healthy). The LR's own
history says more:

- **it jumped** (one step's LR >= 1.5x the step before, from 10 steps before the onset until now -- a schedule
  raised on resume): back to the LR before the jump, where the loss was healthy (bench/natural: the raised
  schedule ended 1.8% above healthy instead of 5.9% after two halvings);
- otherwise: ``recovery.lr_factor``, as before.

Never less of a cut than ``lr_factor``. Pure: the guard hands it the LRs it recorded (rank 0's, from the AGREE
table, so every rank computes the same cut).

Tried and left out: where the LR was still *rising* into the onset (a warmup to a peak far too high), a tenth of
the LR at the loss's best (the LR range test's rule, fastai's ``lr_find``). Measured on the corpus it did not help:
the rollback lands on a checkpoint the too-high LR had already damaged (the first save comes after the damage), and
from there a sane LR walks the weights back about ten times slower than they were pushed away (warmup in 1 step:
+155% against healthy where halvings gave +49%). It needs a checkpoint from before the LR went wrong -- the run's
first step -- first.
"""
from __future__ import annotations

from collections import deque

JUMP = 1.5       # one step's LR over the step before: a jump
BEFORE = 10      # steps before the onset a jump may have come (the loss answers an LR jump within a few steps)


class LrHistory:
    """The LR each recent step's update used (rank 0's)."""

    def __init__(self, maxlen: int = 256):
        self.steps: deque[tuple[int, float]] = deque(maxlen=maxlen)

    def record(self, step: int, lr: float) -> None:
        while self.steps and self.steps[-1][0] >= step:  # (a rollback went back: its undone steps go)
            self.steps.pop()
        self.steps.append((step, lr))

    def at(self, step: int) -> float | None:
        """The LR of the newest recorded step <= ``step`` (the oldest recorded when none is)."""
        best = None
        for s, lr in self.steps:
            if s > step:
                break
            best = lr
        if best is None and self.steps:
            best = self.steps[0][1]
        return best

    def rewound(self, to_step: int) -> None:
        while self.steps and self.steps[-1][0] > to_step:
            self.steps.pop()

    def cut(self, onset: int, now: int, configured: float) -> tuple[float, str]:
        """The LR multiplier for a lowering decided at step ``now`` for a climb that began at ``onset``."""
        lr_now = self.at(now)
        if not lr_now or lr_now <= 0:
            return configured, ""
        seen = list(self.steps)
        for i in range(3, len(seen)):
            s, lr = seen[i]
            prev = seen[i - 1][1]
            if onset - BEFORE <= s <= now and prev > 0 and lr >= JUMP * prev and prev < JUMP * seen[i - 3][1]:
                # (a jump from an LR that held: a warmup's first steps double the LR without jumping)
                return min(configured, prev / lr_now), (
                    f"the LR jumped x{lr / prev:.3g} at step {s}: back to the LR before it ({prev:.3g})")
        return configured, ""
