"""The seams between trainguard's core and a framework, in one place.

An adapter is made of framework calls only; these protocols say which. :class:`Framework` is what the
step driver and the session call (trainguard.driver, trainguard.session); :class:`ScalerControl` and
:class:`DataControl` are two of its parts; :class:`ShardSource` is one rank's state for the in-memory
tier; :class:`Tier` is a checkpoint tier as the checkpoint manager uses it (the memory tier; the disk
tier is the manager itself); :class:`Loop` is what a training loop that owns its iteration counter
(Megatron-LM's, megatron_hooks.lm) tells the adapter. docs/extending.md says who implements which.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Protocol, runtime_checkable

from trainguard.detectors.loss_scale import ScalerState
from trainguard.policy import Decision

@dataclass(frozen=True)
class StepOutcome:
    """What the framework's step did. ``grad_norm`` may be a device tensor (read one step late)."""

    result: Any                      # what the user's call returns (DeepSpeed's step, megatron's tuple)
    applied: bool
    grad_norm: Any = None
    clip_limit: Optional[float] = None


class ScalerControl(Protocol):
    """An fp16 dynamic loss scaler, read from host values and adjusted in place."""

    def state(self) -> ScalerState | None: ...
    def reset(self) -> dict: ...
    def raise_floor(self, factor: float) -> dict: ...


class DataControl(Protocol):
    """A loader that knows its position (trainguard.data.TrackedLoader)."""

    def set_aside(self, sample_ids) -> None: ...
    def skip(self, batches: int) -> None: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


@runtime_checkable
class Framework(Protocol):
    """What the driver needs of a framework; each adapter implements it for its own."""

    rank: int
    checkpointer: Any          # trainguard.checkpoint.manager.CheckpointManager, or None
    data: DataControl | None   # None: the data loader is the user's (megatron)
    applied_grad: Any          # trainguard.appliedgrad.AppliedGradMeter on the inner optimizer, or None

    def completed_steps(self) -> int:
        """Optimizer steps done (DeepSpeed's global_steps, megatron's iteration); a load sets it back."""

    def scaler(self) -> ScalerControl | None:
        """The fp16 dynamic loss scaler when one is on and watched, else None."""

    def agree_scale(self) -> tuple[float, float]:
        """(loss scale, gradient divisor) the local gradient norms are divided by at AGREE."""

    def set_clip(self, max_norm: float) -> None:
        """The max-norm the framework's own clipping uses from this step on."""

    def apply(self, decision: Decision, base_step: Callable[[], Any]) -> StepOutcome:
        """Apply the optimizer step (``base_step``), or take the framework's skip path."""

    def lr_groups(self) -> list[dict]:
        """The optimizer's param groups (their ``lr`` is scaled around a step)."""

    def after_rollback(self, step: int) -> dict:
        """Right after a rollback's load (``completed_steps()`` = the checkpoint's step). A framework
        whose loop rewinds with it returns {}; one whose loop owns its step counter and goes on
        (Megatron-LM) sets ``completed_steps()`` back to ``step`` and says what the loop kept."""

    def skipped_steps(self) -> int:
        """The framework's own count of steps not applied (for the metric line)."""

    def reset_moments(self) -> int:
        """Zero Adam's moment estimates, wherever the framework keeps them; the elements zeroed."""

    def fallback_to_bf16(self, step: int) -> dict:
        """Turn the fp16 run into a bf16 one in place; raise FallbackUnavailable with advice."""


class ShardSource(Protocol):
    """One framework's shard of one rank (the adapter's part of the tier)."""

    def unsupported(self) -> str | None:
        """Why this setup cannot snapshot a rank alone (a collective would be needed), or None."""

    def estimated_bytes(self) -> int:
        """About what one shard takes, before the first is written (the start-of-run space check)."""

    def step(self) -> int:
        """The step a snapshot taken now stands for."""

    def fits(self) -> dict:
        """(Optional) the manifest layout values a shard must have to load here, beyond the world size."""

    def capture(self, staging_root: Path, tag: str, step: int) -> tuple[list, list, Any]:
        """This rank's state as host copies: ``(writes, json_writes, manifest)`` -- ``writes`` [(state, path)]
        and ``json_writes`` [(dict, path)] under ``staging_root / tag``, ``manifest`` without its files table.
        Raises OSError when node memory cannot take it (a failed snapshot, never a failed step)."""


class Tier(Protocol):
    """A checkpoint tier beside the disk (trainguard.checkpoint.memory_tier.MemoryTier), as the
    checkpoint manager drives it: every rank calls every method together, except ``poll``."""

    def take(self) -> str:
        """A snapshot of every rank's state now (or nothing, when not due); returns its tag or ''."""

    def poll(self, wait: bool = False) -> None:
        """Commit what finished writing in the background (``wait``: wait for it first)."""

    def choose(self, lo: int = 0, hi: float = float("inf"), only: set[str] | None = None) -> tuple[str, int] | None:
        """The newest snapshot with ``lo <= step <= hi`` that every rank holds or can fetch: (tag, step)."""

    def fetch(self, tag: str) -> list[int]:
        """Bring ``tag`` back to the ranks that lost it (from their peers' copies); the ranks that fetched."""

    def wait(self) -> None:
        """Wait for the background writer (before snapshots are dropped or the run ends)."""

    def close(self) -> None:
        """The end of the run: the writer finished, node memory freed."""


class Loop(Protocol):
    """A training loop that owns its iteration counter and scheduler (Megatron-LM's: megatron_hooks.lm.LMRun)."""

    scheduler: Any

    def warmup_steps(self) -> int | None:
        """The LR warm-up, in steps (None: none; -1: unknown)."""

    def not_applied(self) -> None:
        """A step the guard skipped: the loop counts it as its own skipped iteration."""

    def rolled_back(self, loaded_step: int, step: int) -> dict:
        """A rollback loaded ``loaded_step`` while the loop goes on at ``step``: what the loop kept."""
