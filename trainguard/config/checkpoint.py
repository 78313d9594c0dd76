"""The block's ``checkpoint`` section (trainguard.config): disk checkpoints and the in-memory snapshot tier."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import ConfigDict, Field, model_validator

from trainguard.config.base import PathStr, _Section


class SnapshotConfig(_Section):
    """The in-memory tier: every few steps each rank's own shard of the full state goes to node-local shared
    memory (and a copy to a rank on another node), so that a lost process, or a lost node, comes back from memory
    rather than from the last disk checkpoint (trainguard/checkpoint/memory_tier.py, for every adapter)."""

    every_steps: int = Field(
        0, ge=0, description="Take a snapshot every N optimizer steps (0: no in-memory tier). Each rank copies its "
        "shard (module, optimizer partition, scheduler, loss scaler, RNG, data position, guard state) to host "
        "memory on the step (the blocking part, reported as blocking_s) and a background thread writes it to `dir` "
        "under the same manifest checks as a disk checkpoint. Resume and rollback take the newest valid tier. Needs "
        "checkpoint.dir (the snapshots belong to the run whose checkpoints live there); DeepSpeed ZeRO 0-2, megatron-core "
        "and Megatron-LM (each rank's model slices, optimizer state and main parameters; loads at the same layout).")
    dir: PathStr = Field(
        "/dev/shm/trainguard-{uid}", description="Node-local memory the snapshots are written to: a tmpfs outlives the "
        "process (a restarted rank finds its shard there) but not the node. Each run has a folder of its own in it "
        "(named by the id kept in checkpoint.dir), freed when the engine is destroyed at the end of the run. {uid} is "
        "your user id: the folder is yours alone -- created 0700, files 0600, and refused by name where it (or a "
        "folder below it) is a symlink, belongs to another user or is writable by others (shards are pickles).")
    max_overhead: Optional[float] = Field(
        None, gt=0, lt=1, description="A cost budget, as a fraction of the training time (e.g. 0.01): the snapshots are "
        "spaced so that their cost -- the blocking copy plus the background writer's CPU time, counted as taken from "
        "training (it is where the cores are all busy; on a GPU node an upper bound) -- stays within it; every_steps "
        "is then the shortest interval. Every rank agrees on the figures (one small all-gather per snapshot), so all "
        "snapshot on the same steps. null: every every_steps steps, whatever it costs.")
    keep: int = Field(2, ge=1, description="Snapshots kept per rank (and per peer copy held), newest first.")
    peer_copy: bool = Field(
        True, description="Also send each rank's shard to a rank on the next node, which keeps it in its node's "
        "memory: a node lost with its memory comes back from its peers' copies. Only where the job spans nodes.")
    ranks_per_node: Optional[int] = Field(
        None, ge=1, description="How ranks map onto nodes: consecutive groups of this many (null: by host name). "
        "Set it to simulate nodes on one machine (tests, drills).")


class CheckpointConfig(_Section):
    """Full, verified checkpoints through DeepSpeed's own save/load, committed atomically."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, strict=True)

    dir: Optional[PathStr] = Field(
        None, description="Checkpoint directory for periodic saves and automatic resume. null: only your own "
        "engine.save_checkpoint/load_checkpoint calls (which still get the commit protocol and verification).")
    every_steps: int = Field(0, ge=0, description="Save every N optimizer steps (0: never on its own).")
    keep_last: int = Field(3, ge=1, description="Committed checkpoints kept, newest first (besides stable ones).")
    keep_stable: int = Field(2, ge=0, description="The newest this-many stable checkpoints are never deleted.")
    stable_after: int = Field(
        200, ge=1, description="A checkpoint becomes stable once this many steps after it pass with no anomaly.")
    first_step: bool = Field(
        True, description="With every_steps: also save after a fresh run's first step, in dir/.first (apart from the "
        "periodic ones: retention and resume never see it; removed once the run has grown past young: "
        "trainguard.recovery.lrcut). Where a young run whose LR was too "
        "high from the start goes back to (recovery.lr_cut), and a young run's bf16 fallback whose LR was still rising "
        "starts over from (saving it again in bf16): a checkpoint from before the damage, which the first periodic "
        "save comes too late for. Written in the background whatever `async` says: the step blocks only for the copy "
        "to host memory (DeepSpeed: its own save's files; megatron: each rank's own state -- dist_checkpointing's save "
        "is a collective --, what data-parallel replicas share written once by the first of them, which loads at the "
        "same layout only, as this run's restart does).")
    hmac_key_env: Optional[str] = Field(
        None, min_length=1, description="Authenticated checkpoints: the name of an environment variable (set on every "
        "rank) holding a secret key of at least 16 bytes. Every checkpoint committed is signed (manifest.hmac, an HMAC-SHA256 of the "
        "manifest, which lists every file's sha256), and a checkpoint without a valid signature is refused -- "
        "checked before any of its files is opened (DeepSpeed's and dist_checkpointing's files are pickles: code). "
        "null: no signatures (the sha256 manifest then catches rot, not tampering).")
    resume: Literal["latest_valid", "stable", "none"] = Field(
        "latest_valid", description="At initialize, when `dir` holds checkpoints: the newest one whose checksums "
        "verify, the newest stable one, or none (start fresh).")
    verify_steps: int = Field(
        5, ge=0, description="After a resume, compare this many losses with those recorded after the save.")
    verify_rtol: float = Field(
        1e-3, ge=0, description="Relative tolerance of that comparison (0: must be identical).")
    async_: bool = Field(
        False, alias="async", description="Copy state to host memory and write in a background thread; a new "
        "save waits for the previous one. Where the node's memory (what /proc/meminfo and the job's cgroup say is "
        "available) cannot hold every local rank's copies with a margin, the save is written synchronously instead "
        "and the first such save says why (trainguard.checkpoint.hostroom); the first step's checkpoint likewise.")
    dataset_id: Optional[str] = Field(None, description="Lineage: an identifier of the training data.")
    dataset_version: Optional[str] = Field(None, description="Lineage: its version or content hash.")
    snapshot: SnapshotConfig = Field(default_factory=SnapshotConfig)

    def saves(self) -> str:
        """Whose saves the checkpoints are, as the banner and ``trainguard validate`` both say it."""
        if not self.dir:
            return "your framework's own saves, committed and verified (none of trainguard's: checkpoint.dir)"
        return f"{self.dir} every {self.every_steps} steps" if self.every_steps else str(self.dir)

    @model_validator(mode="after")
    def _snapshots_need_dir(self):
        if self.snapshot.every_steps and not self.dir:
            raise ValueError("snapshot.every_steps needs 'dir': the snapshots belong to the run whose checkpoints "
                             "live there")
        return self
