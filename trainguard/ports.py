"""What an adapter implements, and the core's parts it implements it with -- the adapters' one door into the core.

An adapter (``ds_plugins``, ``megatron_hooks``, a third one: docs/extending.md) imports from six core modules only:
this one, :mod:`trainguard.step.session` (the run on one rank: the lifecycle and the loop points), :mod:`trainguard.config`
(the block, parsed once), :mod:`trainguard.errors`, :mod:`trainguard.events` (the names of actions and records) and
:mod:`trainguard.bootstrap` (the zero-code entry). tests/unit/test_structure.py holds both adapters to that list, so
the core's modules can move behind these names without an adapter noticing.

The ports (:mod:`trainguard.protocols`): :class:`Framework` (the step, the scaler, the LR, the moments, the precision
switch), :class:`State` (the framework's state: write staged bytes and return their hashes, load through a verified
reader, say its layout) and :class:`ShardSource` (one rank's shard for the memory tier), :class:`Loop` (a loop that
owns its iteration). The parts, one group per port:
"""
from __future__ import annotations

from trainguard import __version__ as CORE_VERSION
from trainguard.support import releases
from trainguard.protocols import DataControl, Framework, Loop, ScalerControl, ShardSource, State, StepOutcome
from trainguard.verdicts import ScalerState
from trainguard.step.launchgate import LaunchGate  # (the step decided at its update's launch: Framework.launch_gate)

# the model: the gradient and output hooks, the poison of a batch fault, what a replay keeps and the replays of a
# plain torch module, the applied gradient
from trainguard.step.appliedgrad import AppliedGradMeter
from trainguard.ranks.bits import digest
from trainguard.recovery.moments import zero_adam_moments
from trainguard.recovery.lrapply import goes_on
from trainguard.faults.poison import PoisonFirstLeaf
from trainguard.step.gradhooks import install as install_grad_hooks
from trainguard.replay.localize import OutputFlags
from trainguard.replay.outputs import finite_proxy, output_value, rng_state, row_of, rows_of, scalar_loss, set_rng_state
from trainguard.replay.probes import FiniteWatch, first_nonfinite, preserved_rng
from trainguard.replay.module_replays import ModuleReplays

# the state: staged writes with their hashes, verified reads, the host copy of the memory tier, which folder resumes
from trainguard.checkpoint.async_writer import snapshot as host_copy
from trainguard.checkpoint.auth import key_from
from trainguard.checkpoint.fsio import save_hashed
from trainguard.checkpoint.hostroom import by_turns
from trainguard.checkpoint.layout import STAGING, CheckpointError, check_own_dir
from trainguard.checkpoint.resume import first_resumable, newest_resumable_folder
from trainguard.checkpoint.verified_io import load_weights, verified_reads
from trainguard.checkpoint.write_hashes import hashed_writes
from trainguard.metrics.sharedfs import open_append

# the data: the position of a loader, the sanitiser, the sample ids carried through a loader a framework built
from trainguard.data.position import DataPosition, TrackedLoader
from trainguard.data.sanitize import active as sanitizing
from trainguard.data.sanitize import sanitize
from trainguard.data.sample_tags import UNTAGGED, tag_loader, take_tags, untag

# where the run is: ranks, the device collectives run on, the world a supervised job forms again (trainguard.liveness.world)
from trainguard.ranks.isolation import broadcast_from_rank0, collective_device, gather_coords, rank, world
from trainguard.liveness.world import World
from trainguard.liveness.replacement import (
    forget_framework, reentered, reentering, remember_attributes, replace_rank, surviving,
)
from trainguard.liveness.spare import check_backend, close_window, form
from trainguard.bootstrap.default_group import open_default as open_default_group

# what a run may ask of this adapter (its capabilities, declared once) and of this release
from trainguard.prevent.checks import RunFacts, bf16_supported
from trainguard.support.support import Refusal, check_release, check_supported, refuse_flags

__all__ = [
    "CORE_VERSION", "releases", "DataControl", "Framework", "Loop", "ScalerControl", "ShardSource", "State",
    "StepOutcome", "ScalerState", "AppliedGradMeter", "LaunchGate", "digest", "zero_adam_moments", "goes_on", "PoisonFirstLeaf",
    "install_grad_hooks", "OutputFlags", "finite_proxy", "output_value", "rng_state", "row_of", "rows_of",
    "scalar_loss", "set_rng_state", "FiniteWatch", "first_nonfinite", "preserved_rng", "host_copy", "key_from",
    "save_hashed", "by_turns", "STAGING", "CheckpointError", "first_resumable", "newest_resumable_folder", "load_weights", "verified_reads", "hashed_writes",
    "DataPosition", "TrackedLoader", "sanitizing", "sanitize", "broadcast_from_rank0", "collective_device",
    "gather_coords", "rank", "world", "World", "check_backend", "forget_framework", "form",
    "close_window", "reentered", "reentering", "remember_attributes", "replace_rank", "surviving", "RunFacts", "bf16_supported", "Refusal",
    "check_release", "check_supported", "refuse_flags", "check_own_dir", "ModuleReplays", "UNTAGGED", "tag_loader",
    "take_tags", "untag", "open_default_group", "open_append",
]
