"""The health around a checkpoint, after it was written (framework-free bookkeeping).

- *Stable marks*: a checkpoint becomes stable once the ``stable_after`` steps after it passed with
  no anomaly. The newest stable checkpoint is the safe rollback target: the newest one may already
  hold the damage of a spike that had not shown yet.
- *Trajectory*: the losses of the ``verify_steps`` steps after a save, recorded so that a resume
  from it can check that the loss curve continues smoothly (the checkpoint's self-test).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class _Watch:
    tag: str
    step: int
    losses: dict[int, float] = field(default_factory=dict)
    trajectory_written: bool = False
    spoiled: bool = False


class CheckpointHealth:
    def __init__(self, stable_after: int, verify_steps: int):
        self.stable_after = stable_after
        self.verify_steps = verify_steps
        self.watching: list[_Watch] = []

    def saved(self, tag: str, step: int) -> None:
        self.watching.append(_Watch(tag, step))

    def on_step(self, step: int, loss: float | None, anomaly: bool) -> list[tuple]:
        """Returns actions: ``("trajectory", tag, {step: loss})`` and ``("stable", tag, step)``."""
        actions = []
        for w in list(self.watching):
            if step <= w.step:
                continue
            if anomaly:
                w.spoiled = True
            if not w.trajectory_written and len(w.losses) < self.verify_steps:
                w.losses[step] = loss if loss is not None and math.isfinite(loss) else None
            if not w.trajectory_written and (len(w.losses) >= self.verify_steps or self.verify_steps == 0):
                w.trajectory_written = True
                if self.verify_steps:
                    actions.append(("trajectory", w.tag, dict(w.losses)))
            if w.spoiled:  # never stable; stop watching once its trajectory is recorded
                if w.trajectory_written:
                    self.watching.remove(w)
                continue
            if step >= w.step + self.stable_after and w.trajectory_written:
                actions.append(("stable", w.tag, step))
                self.watching.remove(w)
        return actions


@dataclass
class ResumeCheck:
    """Compares the losses after a resume with those the original run recorded after the save."""

    tag: str
    expected: dict[int, float | None]
    rtol: float
    seen: dict[int, float | None] = field(default_factory=dict)

    def on_step(self, step: int, loss: float | None) -> dict | None:
        if step not in self.expected or step in self.seen:
            return None
        self.seen[step] = loss
        if len(self.seen) < len(self.expected):
            return None
        diffs = []
        for s, want in sorted(self.expected.items()):
            got = self.seen.get(s)
            if want is None or got is None:
                diffs.append((s, want, got, math.inf if (want is None) != (got is None) else 0.0))
            else:
                diffs.append((s, want, got, abs(got - want) / max(abs(want), 1e-12)))
        worst = max(d[3] for d in diffs)
        return {"tag": self.tag, "ok": worst <= self.rtol, "max_rel_diff": worst, "rtol": self.rtol,
                "steps": [{"step": s, "recorded": w, "resumed": g} for s, w, g, _ in diffs]}
