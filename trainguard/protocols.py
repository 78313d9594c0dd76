"""The seams between trainguard's core and a framework, in one place.

An adapter is made of framework calls only; these protocols say which. :class:`Framework` is what the
step driver and the session call (trainguard.step.driver, trainguard.step.session); :class:`ScalerControl` and
:class:`DataControl` are two of its parts; :class:`State` is the framework's state as the checkpoint manager
saves and loads it (the whole protocol -- staging, hashes, manifest, signature, commit, async, conversion cache,
sidecars -- is the core's); :class:`ShardSource` is one rank's state for the in-memory tier; :class:`Tier` is a checkpoint tier as the checkpoint manager uses it (the memory tier; the disk
tier is the manager itself); :class:`Loop` is what a training loop that owns its iteration counter
(Megatron-LM's, megatron_hooks.lm) tells the adapter. docs/extending.md says who implements which.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Protocol, runtime_checkable

from trainguard.verdicts import ScalerState
from trainguard.decisions import Decision

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
    """A loader that knows its position (trainguard.data.position.TrackedLoader)."""

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
    applied_grad: Any          # what applied_grad_meter() built (the session sets it; the driver reads it)

    def completed_steps(self) -> int:
        """Optimizer steps done (DeepSpeed's global_steps, megatron's iteration); a load sets it back."""

    def scaler(self) -> ScalerControl | None:
        """The fp16 dynamic loss scaler when one is on and watched, else None."""

    def agree_scale(self) -> tuple[float, float]:
        """(loss scale, gradient divisor) the local gradient norms are divided by at AGREE."""

    def set_clip(self, max_norm: float) -> None:
        """The max-norm the framework's own clipping uses from this step on."""

    def applied_grad_meter(self) -> Any:
        """A trainguard.step.appliedgrad.AppliedGradMeter on the torch optimizer(s) that apply the framework's clipped
        gradients, or None: built by the session at start and again after a precision switch rebuilt them."""

    def apply(self, decision: Decision, base_step: Callable[[], Any]) -> StepOutcome:
        """Apply the optimizer step (``base_step``), or take the framework's skip path. (Optional beside it:
        ``launch_gate()`` -> a trainguard.step.launchgate.LaunchGate, or None, for a step DECIDE can wait in until the
        update's launch; the driver then runs ``apply`` with CONTINUE inside the gate.)"""

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
        """Turn the fp16 run's framework objects into bf16 ones in place; raise FallbackUnavailable with advice.
        Called through GuardSession.to_bf16, which arms again what depends on the precision."""


class State(Protocol):
    """The framework's state, as trainguard.checkpoint.manager.CheckpointManager saves and loads it: framework calls
    only. The manager owns everything else -- the staging folder, hashes, the manifest (one schema), the signature,
    the commit, async saves, the conversion cache, the sidecars (RNG, data position), retention and the choices."""

    name: str                  # the manifest's layout.framework ("deepspeed", "megatron-core")
    format: str | None         # the checkpoint_saved record's format, if any
    nothing: Any               # what load returns when there was nothing to load (the framework's convention)

    def step(self) -> int:
        """Optimizer steps done (the tag and manifest step of a checkpoint taken now)."""

    def layout(self) -> dict:
        """The manifest layout: world, dp, tp, pp, precision, and what else decides what loads where."""

    def versions(self) -> dict:
        """The framework's own release(s) for the manifest's lineage."""

    def health(self) -> dict:
        """The framework's figures for the manifest's health (e.g. skipped_steps)."""

    def precision_bound(self) -> bool:
        """Whether a checkpoint of another precision fails to load (then a precision change sets older ones aside)."""

    def write(self, staged: Path, tag: str, **kwargs) -> dict:
        """Every rank: the framework's files of a checkpoint under ``staged``; returns ``{relpath: {sha256, size}}``
        of those hashed in-process while written (any other file is hashed by rank 0 at the commit)."""

    def capture(self, staging_root: Path, tag: str, **kwargs) -> list | None:
        """An async save's blocking part: [(host copy, path)] of the files ``write`` would write (None: no async)."""

    # (optional) capture_local(staging_root, tag) -> list: where ``capture`` cannot (the framework's save is a
    # collective), this rank's state as host copies, loadable at this layout only -- the first step's insurance
    # (trainguard.checkpoint.first), which only this run's restart loads; ``load`` tells it by its files.

    def sidecar(self, **kwargs) -> dict:
        """This rank's framework part of its sidecar (the data position, a framework's own RNG trackers, ...)."""

    def restore_sidecar(self, side: dict) -> None:
        """After the RNG came back from this rank's sidecar: the framework's part of it (not the data position)."""

    def use_data(self, data: Any, result: Any) -> Any:
        """A resume's data position (the sidecar's, merged across the old ranks when resharded): put it back;
        returns what ``CheckpointManager.load`` returns."""

    def conversion(self, man) -> bool:
        """Whether checkpoint ``man`` (a Manifest) loads here only through a converted copy (:meth:`convert`);
        raises UnsupportedSetup or CheckpointError when it cannot load here at all."""

    def convert(self, source: Path, out: Path) -> str | None:
        """The framework's conversion of the checkpoint folder ``source`` into ``out``; an error text or None."""

    def load(self, root: Path, tag: str, man, reader, purpose: str, converted: bool = False, **kwargs) -> tuple[Any, dict]:
        """Every rank: the framework's state of ``root/tag``, every byte read through ``reader``. Returns (what
        ``CheckpointManager.load`` returns, facts for the ``resume`` record)."""

    def load_shard(self, own: Path, tag: str, reader, purpose: str, **kwargs) -> tuple[Any, dict]:
        """Every rank: this rank's shard ``own/tag`` of the in-memory tier, through ``reader``."""

    def shard_source(self) -> "ShardSource | None":
        """This framework's part of the in-memory tier (None: no in-memory tier here)."""


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

    def capture(self, staging_root: Path, tag: str, step: int) -> list:
        """This rank's framework state as host copies, [(state, path)] under ``staging_root / tag`` (the tier adds
        the sidecar, the guard's state and the manifest). Raises OSError when node memory cannot take it (a failed
        snapshot, never a failed step)."""


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

    def last_step(self) -> int | None:
        """The loop's last step (None: unknown): its count goes on through a rollback."""

    def not_applied(self) -> None:
        """A step the guard skipped: the loop counts it as its own skipped iteration."""

    def rolled_back(self, loaded_step: int, step: int) -> dict:
        """A rollback loaded ``loaded_step`` while the loop goes on at ``step``: what the loop kept."""
