"""Verdicts -> one action. Pure: the same inputs give the same action on every rank.

This issue's ladder is short: a non-finite verdict skips the step (or aborts, when configured),
and ``max_consecutive`` non-finite steps in a row abort with a report, so a run that cannot
recover does not skip forever.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from trainguard.config import NonfiniteConfig
from trainguard.detectors.base import Verdict
from trainguard.events import Action


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str
    verdicts: tuple[Verdict, ...] = field(default_factory=tuple)


class Policy:
    def __init__(self, nonfinite: NonfiniteConfig):
        self.nonfinite = nonfinite
        self.consecutive_nonfinite = 0
        self.total_nonfinite = 0

    def decide(self, verdicts: Sequence[Verdict]) -> Decision:
        verdicts = tuple(verdicts)
        nonfinite = [v for v in verdicts if v.anomaly == "nonfinite"]
        if not nonfinite:
            self.consecutive_nonfinite = 0
            return Decision(Action.CONTINUE, "healthy", verdicts)
        self.consecutive_nonfinite += 1
        self.total_nonfinite += 1
        ranks = sorted({r for v in nonfinite for r in v.ranks})
        if self.nonfinite.action == "abort":
            return Decision(Action.ABORT, f"non-finite values on rank(s) {ranks}; action is 'abort'", verdicts)
        if self.consecutive_nonfinite >= self.nonfinite.max_consecutive:
            return Decision(
                Action.ABORT,
                f"{self.consecutive_nonfinite} non-finite steps in a row (max_consecutive="
                f"{self.nonfinite.max_consecutive}); last on rank(s) {ranks}", verdicts)
        return Decision(Action.SKIP_STEP, f"non-finite values on rank(s) {ranks}", verdicts)

    def state_dict(self) -> dict:
        return {"consecutive_nonfinite": self.consecutive_nonfinite, "total_nonfinite": self.total_nonfinite}

    def load_state_dict(self, state: dict) -> None:
        self.consecutive_nonfinite = int(state["consecutive_nonfinite"])
        self.total_nonfinite = int(state["total_nonfinite"])
