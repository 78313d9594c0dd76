"""The typed "trainguard" block, parsed once where the JSON enters.

The block lives in the same ds_config that DeepSpeed reads (DeepSpeed ignores unknown top-level
blocks and stores them in its checkpoints). Everything downstream receives these frozen models,
never the raw dict. Unknown keys are errors naming the full path with a did-you-mean; every
problem is collected into one :class:`ConfigError`.

The JSON Schema (``configs/trainguard.schema.json``) and the reference page
(``docs/config-reference.md``) are generated from these models: ``python -m trainguard.reference``.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from trainguard.config_problems import told
from trainguard.errors import ConfigError

BLOCK = "trainguard"
FAULTS_REFUSED = ("faults are listed but 'allow_faults' is not true; fault injection is refused in a "
                  "config that does not opt in")
FAULT_TYPES = ("nan_loss", "inf_grad", "nan_batch", "spike_batch", "lr_ramp", "inf_activation",
               "attention_collapse", "bad_label")


def _usable_path(value: str) -> str:
    if not value or not value.strip():
        raise ValueError("an empty path: give a file or directory, or null")
    if "\x00" in value:
        raise ValueError("a path with a NUL character cannot be opened")
    return value


# a file or directory the run writes to or reads from: checked here, not at its first use on every rank
PathStr = Annotated[str, AfterValidator(_usable_path)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)  # (JSON: true is no number, 0 no bool)


class PluginSpec(_Section):
    """An extension by name: a registered one, or your own ``package.module:Name`` (trainguard/plugins.py)."""

    type: str = Field(min_length=1, description="A registered name, or 'package.module:Name' of a class or factory.")
    options: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments it is built with.")


class NonfiniteConfig(_Section):
    """Non-finite loss and gradients, checked on each rank's local values."""

    enabled: bool = Field(True, description="Check every step's local loss and local gradients for NaN/Inf.")
    check_grads: bool = Field(
        True,
        description="Also check gradients (a tensor hook per parameter, before the data-parallel "
        "reduction). Off: only the loss is checked.")
    action: Literal["skip_step", "abort"] = Field(
        "skip_step",
        description="What every rank does when any rank's values are non-finite: skip the optimizer "
        "step on all ranks, or stop the run on all ranks with a report.")
    max_consecutive: int = Field(
        20, ge=1,
        description="Abort (with a report) after this many non-finite steps in a row: a run that "
        "never recovers should not skip forever.")


class LossSpikeConfig(_Section):
    """Loss against its robust moving statistics; spikes classified slow_rise / instant_burst."""

    enabled: bool = Field(True, description="Alert when the step's loss (mean over ranks) spikes.")
    window: int = Field(128, ge=8, description="Healthy steps kept for the median and MAD.")
    z: float = Field(6.0, gt=0, description="Spike when (loss - median) / MAD exceeds this.")
    min_history: int = Field(20, ge=3, description="Steps observed before any alert.")


class LossTrendConfig(_Section):
    """A loss that climbs step by step away from its best (what a median/MAD window absorbs): the smoothed
    loss (median of the last ``smooth`` steps) against the best it reached; classified slow_rise /
    instant_burst from the loss, the gradient norm and the LR together."""

    enabled: bool = Field(True, description="Watch the smoothed loss (mean over ranks) against its best.")
    smooth: int = Field(8, ge=3, description="Steps whose median is the smoothed loss (one bad batch cannot move it).")
    rise: float = Field(0.2, gt=0, description="Diverging when the smoothed loss stands this fraction above its "
                        "best (0.2: 20%) ...")
    patience: int = Field(2, ge=1, description="... for this many steps in a row.")
    min_history: int = Field(20, ge=3, description="Steps observed before any verdict.")


class GradNormConfig(_Section):
    """Gradient-norm surge (one-step jump) and sustained rise (the precursor of an explosion)."""

    enabled: bool = Field(True, description="Watch the RMS of the ranks' local gradient norms.")
    window: int = Field(128, ge=8, description="Healthy steps kept for the median and MAD.")
    z: float = Field(6.0, gt=0, description="Surge when (norm - median) / MAD exceeds this.")
    min_history: int = Field(20, ge=3, description="Steps observed before any alert.")
    trend_steps: int = Field(12, ge=3, description="Steps over which a sustained rise is measured.")
    trend_rise: float = Field(
        0.03, gt=0, description="Rise alert when log(norm) grows faster than this per step (least squares) "
        "over trend_steps, all above the median. 0.03/step = +43% over 12 steps.")
    surges_to_rise: int = Field(3, ge=0, description="This many grad_surge alerts within surge_window steps, while "
                                "the loss stands 5% above its best level (detectors.loss_trend), are a slow_rise (an "
                                "irregular surge never gives a clean log-slope; a bad batch's surge does not count; "
                                "0: never).")
    surge_window: int = Field(50, ge=2, description="Steps over which grad_surge alerts are counted.")


class StragglerConfig(_Section):
    """A rank that is alive but slow (a throttled GPU, a bad link, a noisy neighbour)."""

    enabled: bool = Field(True, description="Compare every rank's own compute time per step (data + forward, "
                          "carried in the per-step AGREE table: no extra sync) with the median rank's.")
    window: int = Field(20, ge=3, description="Steps over which a rank's ratio to the median rank is taken "
                        "(its median: single noisy steps do not count).")
    slower_by: float = Field(1.5, gt=1, description="Name a rank whose windowed ratio exceeds this (1.5: 50% "
                             "slower than the median rank).")
    persist_steps: int = Field(200, ge=1, description="A straggler slow for this many steps has its host written "
                               "to suspect_hosts.json (what a launcher excludes on restart).")
    min_step_s: float = Field(0.0, ge=0, description="Ignore steps whose median compute time is below this.")


class ReplicaCheckConfig(_Section):
    """Silent data corruption in the weights: the replicas of a data-parallel group must hold the same bits."""

    enabled: bool = Field(False, description="Every `every_steps` steps each rank adds a digest of its replicated "
                          "parameters to the per-step AGREE table (no extra collective); a rank whose digest differs "
                          "from its replicas' (same tensor/pipeline coordinates) is named (replica_mismatch) and the "
                          "replica_mismatch ladder acts, from before the last step they agreed. Replicated: every "
                          "parameter at ZeRO 0-2 and in megatron's DDP (the distributed optimizer's model parameters "
                          "too); ZeRO-3's partitions are not checked.")
    every_steps: int = Field(100, ge=1, description="Steps between two digests (each reads every parameter once).")


class PeerReplayConfig(_Section):
    """Silent data corruption in the compute: a data-parallel peer replays a rank's micro-batch on its identical
    weights, and the rank that computes differently is named."""

    enabled: bool = Field(False, description="Every `every_steps` steps (and on a spike that neither the data nor "
                          "the weights explain) each rank sends its last micro-batch (its token ids: the inputs, never "
                          "activations) to the next replica of its data-parallel group; both replay it forward-only on "
                          "the same weights with the same random numbers and compare the loss and a digest of the "
                          "model's floating outputs (the logits, where the model returns them). A disagreement is "
                          "arbitrated by every replica of the group replaying that micro-batch: the rank outvoted by "
                          "a majority is named (compute_mismatch, its host suspect); with 2 replicas both are named. "
                          "Needs an adapter that replays (DeepSpeed; megatron with a replayer: Megatron-LM's loop, or "
                          "install(replayer=...)).")
    every_steps: int = Field(100, ge=1, description="Steps between two sampled replays (each costs two forward-only "
                             "passes of one micro-batch per rank and one small all-gather; nothing on other steps).")
    rtol: float = Field(0.0, ge=0, description="0: the replays must agree bit for bit (loss and output digest: "
                        "deterministic kernels, the same on every replica). >0: the losses must agree within this "
                        "relative tolerance and the digests are not compared (non-deterministic kernels).")
    on_spike: bool = Field(True, description="Also replay on a non-finite or burst step whose weights replay healthy "
                           "and whose samples replay healthy (recovery.replay_check: neither the data nor the weights "
                           "explain it): when the culprit's micro-batch replays healthy on the culprit and its peer "
                           "alike, the culprit's training forward computed what neither reproduces, and it is named.")


class AttentionEntropyConfig(_Section):
    """Entropy of attention probabilities per layer and head, sampled."""

    enabled: bool = Field(True, description="Sample attention entropy every `every` steps.")
    every: int = Field(50, ge=1, description="Sampling period in optimizer steps.")
    modules: str = Field(
        r"(^|\.)(softmax|scale_mask_softmax|attn_softmax)$",
        description="Regex on module paths whose output is the attention probabilities "
        "[batch, heads, queries, keys] (a Softmax module, Megatron's scale_mask_softmax).")
    collapse: float = Field(
        0.05, ge=0, le=1, description="Alert when a head's entropy falls below this fraction of its maximum "
        "(log of the number of keys it may attend to): the head attends to one token.")
    saturation: float = Field(
        0.995, gt=0, le=1, description="Alert when a head's entropy exceeds this fraction of its maximum "
        "(uniform attention), once the run is past min_step.")
    min_step: int = Field(500, ge=0, description="No saturation alerts before this step (heads start uniform).")


class ActivationRangeConfig(_Section):
    """Per-module max-abs and RMS of outputs, sampled; Inf/NaN in an activation is a verdict."""

    enabled: bool = Field(True, description="Sample activation ranges every `every` steps.")
    every: int = Field(50, ge=1, description="Sampling period in optimizer steps.")
    max_abs: float = Field(1e4, gt=0, description="Alert when a module's output max-abs exceeds this.")
    modules: Optional[str] = Field(
        None, description="Regex on module paths to watch; null: every leaf module.")


class LocalizeConfig(_Section):
    """Find the first module whose output is non-finite by re-running the forward with hooks."""

    enabled: bool = Field(True, description="On a non-finite verdict, every rank replays its last micro-batch "
                          "with hooks (no gradients, RNG restored) and reports its first non-finite module. "
                          "Sampled checking during the normal forward is activation_range's (every N steps).")


class LossScaleConfig(_Section):
    """fp16 dynamic loss scaling: the scaler's collapse, caught before DeepSpeed stops the run."""

    enabled: bool = Field(True, description="Watch the fp16 loss scaler (scale, floor, overflow streak). With it "
                          "on, DeepSpeed's own stop at the minimum scale is disarmed: the recovery ladder "
                          "'loss_scale' acts instead. No effect in fp32/bf16.")
    max_overflow_streak: int = Field(
        40, ge=2, description="Also a collapse: this many overflowing steps in a row, once the scaler had "
        "found a working scale (an fp16 run that only skips does not train).")


class DetectorsConfig(_Section):
    nonfinite: NonfiniteConfig = Field(default_factory=NonfiniteConfig)
    loss_scale: LossScaleConfig = Field(default_factory=LossScaleConfig)
    loss_spike: LossSpikeConfig = Field(default_factory=LossSpikeConfig)
    loss_trend: LossTrendConfig = Field(default_factory=LossTrendConfig)
    grad_norm: GradNormConfig = Field(default_factory=GradNormConfig)
    straggler: StragglerConfig = Field(default_factory=StragglerConfig)
    replica_check: ReplicaCheckConfig = Field(default_factory=ReplicaCheckConfig)
    peer_replay: PeerReplayConfig = Field(default_factory=PeerReplayConfig)
    attention_entropy: AttentionEntropyConfig = Field(default_factory=AttentionEntropyConfig)
    activation_range: ActivationRangeConfig = Field(default_factory=ActivationRangeConfig)
    localize: LocalizeConfig = Field(default_factory=LocalizeConfig)
    custom: list[PluginSpec] = Field(
        default_factory=list, description="Your detectors (trainguard.plugins.Detector: observe(step, observations) "
        "-> verdicts), run on every rank after the built-in ones; their verdicts are custom_alert records. A 'type' "
        "named by import path is imported at initialize on every rank: its code runs with the job's rights (treat the "
        "block as code); `trainguard validate` checks the block without importing it.")


class ClippingConfig(_Section):
    """Gradient clipping, applied by DeepSpeed's optimizer before the step."""

    mode: Literal["deepspeed", "norm", "value", "adaptive"] = Field(
        "deepspeed", description="deepspeed: leave DeepSpeed's gradient_clipping as configured. norm: clip the "
        "global norm to max_norm. value: clamp every gradient element to [-value, value] (each rank's local "
        "gradient, before the reduction). adaptive: clip to EMA mean + z * EMA std of recent norms (ZClip).")
    max_norm: float = Field(1.0, gt=0, description="norm mode; also adaptive's limit until the EMA is warm.")
    value: float = Field(1.0, gt=0, description="value mode: the element bound.")
    z: float = Field(2.5, gt=0, description="adaptive: clip norms more than z EMA deviations above the EMA mean.")
    ema: float = Field(0.97, gt=0, lt=1, description="adaptive: decay of the norm's EMA mean and variance.")
    warmup_steps: int = Field(25, ge=2, description="adaptive: steps of EMA before it replaces max_norm.")


class SanitizeConfig(_Section):
    """Checks every sample the loader reads, before it reaches the model (host side, no sync)."""

    enabled: bool = Field(True, description="Check samples (only what is configured below is checked).")
    input_key: str = Field("input_ids", description="Key of the token ids in a dict sample.")
    label_key: str = Field("labels", description="Key of the labels in a dict sample.")
    max_seq_len: Optional[int] = Field(None, ge=1, description="Reject samples longer than this.")
    vocab_size: Optional[int] = Field(None, ge=1, description="Token ids and labels must lie in [0, vocab_size).")
    ignore_index: int = Field(-100, description="A label equal to this is ignored by the loss, hence allowed.")
    pad_id: Optional[int] = Field(None, description="Reject samples whose tokens are all pad_id.")
    reject_all_zero: bool = Field(True, description="Reject samples whose tokens (or values) are all zero.")
    action: Literal["drop_sample", "quarantine_batch", "fail"] = Field(
        "drop_sample", description="drop_sample: the batch goes on without it; quarantine_batch: the whole "
        "batch is set aside and the next one is read; fail: stop with an error naming the sample ids.")


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
        "periodic ones: retention and resume never see it; removed at step 400). Where a young run whose LR was too "
        "high from the start goes back to (recovery.lr_cut), and a young run's bf16 fallback whose LR was still rising "
        "starts over from (saving it again in bf16): a checkpoint from before the damage, which the first periodic "
        "save comes too late for.")
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
        "save waits for the previous one.")
    dataset_id: Optional[str] = Field(None, description="Lineage: an identifier of the training data.")
    dataset_version: Optional[str] = Field(None, description="Lineage: its version or content hash.")
    snapshot: SnapshotConfig = Field(default_factory=SnapshotConfig)

    @model_validator(mode="after")
    def _snapshots_need_dir(self):
        if self.snapshot.every_steps and not self.dir:
            raise ValueError("snapshot.every_steps needs 'dir': the snapshots belong to the run whose checkpoints "
                             "live there")
        return self


LadderStep = Literal["alert", "skip_step", "rollback", "rollback_lower_lr", "raise_floor", "bf16_fallback",
                     "abort"]
SCALE_ONLY_STEPS = ("raise_floor", "bf16_fallback")


def _default_ladders() -> dict:
    return {"nonfinite": ["skip_step", "skip_step", "rollback"], "instant_burst": ["rollback"],
            "slow_rise": ["rollback_lower_lr"], "loss_scale": ["bf16_fallback"], "replica_mismatch": ["rollback"],
            "compute_mismatch": ["skip_step"]}


class RecoveryConfig(_Section):
    """Turning verdicts into recovery: ladders per anomaly class, budgets, in-process rollback."""

    enabled: bool = Field(True, description="Act on spikes and repeated non-finite steps (false: alerts and "
                          "skipped steps only).")
    ladders: dict[Literal["nonfinite", "instant_burst", "slow_rise", "loss_scale", "replica_mismatch",
                          "compute_mismatch"],
                  list[LadderStep]] = Field(
        default_factory=_default_ladders,
        description="Per anomaly class, the action for its 1st, 2nd, ... occurrence within ladder_window steps "
        "(the last entry repeats). rollback: to the newest stable checkpoint from before the anomaly's onset, "
        "skipping the batches seen since plus skip_batches; rollback_lower_lr: the same, and the LR x lr_factor "
        "for lr_cooldown_steps. loss_scale (the fp16 scaler collapsed) also takes raise_floor (roll back, reset "
        "the scale, min scale x floor_factor) and bf16_fallback (roll back, then continue in bf16, see "
        "fp16_fallback); its rollbacks reset the scale and skip no batches. Its default goes to bf16 at once: overflows that "
        "persist at the minimum scale are values beyond fp16's range, which no scale reset fixes (rollback, raise_floor "
        "are there for a collapse you know to be transient). replica_mismatch (detectors.replica_check): its "
        "rollback goes to a checkpoint from before the last step the replicas agreed. compute_mismatch "
        "(detectors.peer_replay): a rank computed differently from its replicas on the same micro-batch and weights; "
        "skip_step leaves the step's gradients out (the weights are not damaged: the replicas still agree), and the "
        "named rank's host goes to suspect_hosts.json for the launcher (abort stops the job so that a restart leaves "
        "the host out). A class left out keeps its default.")
    ladder_window: int = Field(100, ge=1, description="Occurrences older than this many steps no longer count.")
    replay_check: bool = Field(
        True, description="On a non-finite or instant_burst step, every rank replays a micro-batch of the last "
        "healthy step on the current weights (no gradients, RNG untouched; DeepSpeed; on megatron forward-only through "
        "its own schedule, every rank of the model-parallel group together: Megatron-LM's loop, or yours with "
        "install(replayer=...)). Healthy: the data was bad and the skipped steps did no damage, so the step is skipped "
        "where a rung says roll back (a burst of k bad batches costs k steps, no rollback). Non-finite or a spike: the "
        "weights are damaged, so it rolls back at once, whatever the rung. false (and a megatron-core loop without a "
        "replayer): the ladders as written.")
    narrow_samples: bool = Field(
        True, description="With replay_check, the culprit rank replays its step's samples one at a time and names, "
        "and quarantines, only the fewest whose removal leaves a healthy batch (at most half of it; else the whole "
        "batch). DeepSpeed ZeRO 0-2 (a ZeRO-3 forward is collective: the whole batch is named there); megatron: the "
        "culprit's model-parallel group replays together (Megatron-LM names the sampler's global sample index; its "
        "loader is its own, so nothing is quarantined there).")
    rollback_to: Literal["stable", "latest_valid"] = Field(
        "stable", description="Which checkpoint from before the onset: the newest stable one, or the newest valid.")
    skip_batches: int = Field(200, ge=0, description="Batches skipped past the anomaly on a rollback (PaLM skipped "
                              "200-500).")
    lr_factor: float = Field(0.5, gt=0, le=1, description="LR multiplier of rollback_lower_lr.")
    lr_cut: Literal["evidence", "factor"] = Field(
        "evidence", description="How far rollback_lower_lr lowers the LR. evidence: if the LR jumped (one step >= "
        "1.5x the one before, from 10 steps before the climb's onset on -- a schedule raised on resume), back to the LR "
        "before the jump; else, for a slow_rise that began in a run's first 200 steps, a tenth of the LR at the loss's "
        "best and a restart from the first step's checkpoint (checkpoint.first_step), once per run; else lr_factor. "
        "Never less of a cut than lr_factor; never below lr_floor (held there once). factor: always lr_factor.")
    lr_cooldown_steps: int = Field(1000, ge=1, description="How long the lowered LR lasts.")
    lr_floor: float = Field(0.01, gt=0, le=1, description="Abort when the accumulated LR factor would go below "
                            "this (lowering it further is not a remedy any more). 0.01: six halvings; a peak LR "
                            "30x too high (bench/natural) needs five.")
    reset_optimizer_moments: bool = Field(False, description="On a rollback, zero Adam's moment estimates (as SPAM "
                                          "does) instead of keeping the checkpoint's.")
    max_rollbacks: int = Field(5, ge=0, description="Rollbacks allowed within rollback_window steps; one more aborts.")
    rollback_window: int = Field(1000, ge=1, description="Window of the rollback budget, in steps.")
    fp16_fallback: Literal["bf16", "none"] = Field(
        "bf16", description="bf16_fallback rung: re-create the engine in bf16 from the rolled-back state (DeepSpeed "
        "ZeRO 0-2: the optimizer state is carried over where the optimizer class stays the same; megatron-core: the "
        "same DDP and optimizer objects turned bf16, fp32 main parameters and optimizer state carried, the "
        "distributed optimizer rebuilt over the bf16 buffers). none: abort instead.")
    floor_factor: float = Field(16.0, gt=1, description="raise_floor rung: the min loss scale (DeepSpeed's, or "
                                "megatron's DynamicGradScaler's) x this.")
    suspect_after: int = Field(3, ge=2, description="Raise suspect_rank when one rank is the culprit this many times "
                               "on different data, each on a step where another rank was healthy (a failure every "
                               "rank shares names no host).")

    @field_validator("ladders")
    @classmethod
    def _ladders_complete(cls, ladders: dict) -> dict:
        for name, steps in ladders.items():
            if not steps:
                raise ValueError(f"ladders.{name}: give at least one step")
            wrong = [x for x in steps if x in SCALE_ONLY_STEPS and name != "loss_scale"]
            if wrong:
                raise ValueError(f"ladders.{name}: {wrong[0]!r} applies only to the 'loss_scale' ladder")
        return {**_default_ladders(), **ladders}


class WatchdogConfig(_Section):
    """Heartbeats and hang detection (trainguard.watchdog)."""

    enabled: bool = Field(True, description="Publish a heartbeat per rank and watch everyone's from a "
                          "background thread (no work on the training thread beyond attribute writes).")
    interval_s: float = Field(5.0, gt=0, description="How often each rank publishes and checks.")
    hang_timeout_s: float = Field(
        900.0, gt=0, description="A rank that has not progressed (changed phase) for this long is hung. Keep it "
        "below collective_timeout_s, so that the watchdog (which names the rank and dumps stacks) acts before "
        "a collective times out.")
    board: Literal["store", "dir"] = Field(
        "store", description="store: the rendezvous store (torchrun's, multi-node). dir: files in `dir` (a "
        "directory every rank can read).")
    dir: Optional[PathStr] = Field(None, description="board 'dir': where the heartbeat files go.")
    stacks_dir: Optional[PathStr] = Field(None, description="Where `stacks.rank<r>.txt` go on a hang (default: beside "
                                      "metrics.jsonl, else the working directory).")
    exit_code: int = Field(75, ge=1, le=255, description="Exit code of every live rank after a hang (75, "
                           "EX_TEMPFAIL: retry). torchrun restarts on any non-zero code; see the README.")
    kill_hung_local: bool = Field(True, description="SIGKILL the hung ranks on this host before exiting (a "
                                  "stopped process otherwise holds torchrun for its SIGTERM grace period).")

    @model_validator(mode="after")
    def _dir_for_dir_board(self):
        if self.enabled and self.board == "dir" and not self.dir:
            raise ValueError("board 'dir' needs 'dir' (a directory every rank can read)")
        return self


class DistributedConfig(_Section):
    """Process-group settings trainguard applies before the framework builds its groups."""

    collective_timeout_s: Optional[float] = Field(
        None, gt=0, description="Timeout of every collective in every process group - the default group and "
        "DeepSpeed's ZeRO/data-parallel groups alike (DeepSpeed's own `timeout` and DEEPSPEED_TIMEOUT reach only "
        "the default group, so a hung rank otherwise stalls the others for 30 minutes on gloo). null: the "
        "frameworks' defaults.")
    fresh_store_per_attempt: bool = Field(
        True, description="Under torchrun, create the default process group on a store prefix of its own per "
        "restart attempt (TORCHELASTIC_RESTART_COUNT): restarted gloo workers otherwise often fail to connect "
        "through stale peer addresses.")
    watchdog: WatchdogConfig = Field(default_factory=WatchdogConfig)
    spares: int = Field(0, ge=0, description="Hot spares, for a job launched under trainguard.supervise (`torchrun "
                        "--nproc-per-node N+S -m trainguard.supervise -- train.py ...`: the supervisor reads it from the "
                        "config file on the command line; `--spares` there wins): the last S of torchrun's workers wait, "
                        "warm, to take a dead rank's place in the same job (docs/liveness.md). Launched otherwise, a "
                        "warning says it is not in effect (a dead rank restarts the job).")


class ChecksConfig(_Section):
    """Start-of-run checks (one warning event each)."""

    enabled: bool = Field(True, description="Warn about fp16-where-bf16-works, missing or short warmup, no clipping.")
    min_warmup_steps: int = Field(100, ge=0, description="Warn when the LR warmup is shorter than this.")


class WandbConfig(_Section):
    """Weights & Biases: the metric lines and records mirrored to a run (rank 0)."""

    project: str = Field(description="The W&B project.")
    name: Optional[str] = Field(None, description="The run's name (default: W&B's).")
    dir: Optional[PathStr] = Field(None, description="Where W&B writes its files (default: W&B's, ./wandb).")
    mode: Optional[Literal["online", "offline", "disabled"]] = Field(
        None, description="W&B's mode (default: its environment, WANDB_MODE). offline: files only, `wandb sync` later.")


class MetricsConfig(_Section):
    """The JSONL event log, the run's source of truth."""

    jsonl: Optional[PathStr] = Field(
        "trainguard.jsonl",
        description="Event and metric log written by rank 0 (one JSON object per line). null: none.")
    per_rank: bool = Field(
        False, description="Also write one file per rank (`<stem>.rank<r>.jsonl`) with its local values.")
    every_steps: int = Field(1, ge=1, description="Write a metric line every N optimizer steps (events always).")
    incident_gap: int = Field(100, ge=0, description="Alerts (records a ladder does not act on) as incidents: the first "
                              "alert of a kind opens one and is written; the same kind within this many steps is "
                              "folded into it (counted, worst value kept); this many steps without one closes it "
                              "(an incident_closed record). 0: every alert written.")
    tensorboard: Optional[PathStr] = Field(None, description="Directory for TensorBoard scalars (rank 0). null: off.")
    prometheus_port: Optional[int] = Field(
        None, ge=0, le=65535, description="Serve Prometheus metrics over HTTP from rank 0 on this port "
        "(0: any free port). null: off.")
    prometheus_addr: str = Field(
        "0.0.0.0", min_length=1, description="The address the Prometheus endpoint binds. 0.0.0.0 (every interface): "
        "a Prometheus server on another host must reach rank 0's node to scrape it. The endpoint serves training "
        "statistics and rank/host labels, no credentials and no controls; bind 127.0.0.1 (scraped through a local "
        "agent) or the node's cluster-network address where other networks can reach the node.")
    wandb: Optional[WandbConfig] = Field(None, description="Mirror to Weights & Biases (needs `pip install wandb`). "
                                         "null: off.")
    sinks: list[PluginSpec] = Field(
        default_factory=list, description="More mirrors of the log on rank 0, by type: 'tensorboard' (logdir), "
        "'prometheus' (port), 'wandb' (project, ...), or your own (trainguard.plugins.Sink: metric, event, close).")


class DataConfig(_Section):
    """The loader handed back when ``training_data`` is given."""

    shuffle: bool = Field(True, description="Shuffle each epoch (a permutation seeded by seed + epoch).")
    seed: int = Field(0, description="Seed of the per-epoch permutation; identical on every rank.")
    drop_last: bool = Field(
        True, description="Drop the tail that does not fill a micro-batch on every data-parallel rank.")


class FaultSpec(_Section):
    """One injected fault. Used by tests, the demo and fire drills; refused unless allow_faults."""

    type: Literal["nan_loss", "inf_grad", "nan_batch", "spike_batch", "lr_ramp", "inf_activation",
                  "attention_collapse", "bad_label", "fp16_overflow", "corrupt_checkpoint", "kill_rank",
                  "hang_rank", "checkpoint_write_error", "slow_rank", "nan_weights", "bitflip", "sdc_compute"] = Field(
        description="nan_loss: the loss passed to backward becomes NaN. inf_grad: one parameter's local gradient "
        "gets +Inf. nan_batch: the batch's floating-point tensors become NaN (an integer-only batch poisons the "
        "output of the model's first leaf module instead). spike_batch: the batch's floating-point tensors are "
        "multiplied by `factor` (an integer-only batch: its loss is). lr_ramp: from `step` on, the LR is "
        "multiplied by `factor` more each step (all ranks). inf_activation: +Inf in the output of `module`. "
        "attention_collapse: the logits into the softmax `module` for `head`, standardised per query, are "
        "multiplied by `factor` (the head collapses onto its top key). "
        "bad_label: one label of the batch becomes vocab-size (out of range), in the loader. "
        "fp16_overflow: +Inf in one parameter's local gradient on every step of [step, step+steps) while the "
        "engine runs fp16, also when those steps re-run after a rollback (values beyond fp16's range: no loss "
        "scale fixes it, bf16 does). corrupt_checkpoint: at the end of `step`, bytes are flipped in the largest "
        "file of the newest committed checkpoint under checkpoint.dir (storage rot; `rank` does it). "
        "kill_rank: the rank SIGKILLs itself at the start of `step` (a dead node). hang_rank: the rank SIGSTOPs "
        "itself there (a hung node). Both only in restart attempt `attempt` (torchrun's restarts plus Slurm's "
        "requeues: TORCHELASTIC_RESTART_COUNT + SLURM_RESTART_COUNT). "
        "checkpoint_write_error: the background write of the async save taken at `step` fails on `rank` after its "
        "first file (a full disk): the checkpoint stays invisible, every rank records checkpoint_failed. "
        "slow_rank: on every step of [step, step+steps) the rank sleeps `factor` (default 0.5) x its previous step's "
        "time before its first forward (a throttled GPU: alive, slower by 1 + factor). nan_weights: at the start of "
        "`step`, NaN is written into `param` on `rank` (silent corruption of the weights in memory: every later step "
        "is non-finite until a rollback reloads them). bitflip: at the start of `step`, bit `bit` of the first element of "
        "`param` flips on `rank` (silent data corruption: finite, and nothing else notices). sdc_compute: on every "
        "step of [step, step+steps) the output of `module` on `rank` is multiplied by 1 + `eps` in every forward of "
        "that rank -- training and replays alike: it stands for a device that computes wrong (finite, silent).")
    step: int = Field(ge=1, description="Optimizer step (1-based, as logged) at which the fault fires.")
    rank: int = Field(0, ge=0, description="Global rank on which the fault fires (lr_ramp: all ranks).")
    steps: int = Field(1, ge=1, description="For how many steps it fires (lr_ramp: how long the ramp lasts).")
    param: Optional[str] = Field(
        None, description="inf_grad, fp16_overflow, nan_weights, bitflip: parameter name (as in "
        "model.named_parameters()); default the first.")
    bit: int = Field(4, ge=0, le=63, description="bitflip: the bit of the element's binary representation that flips "
                     "(0: the lowest mantissa bit; the default 4 is a relative change of ~1e-6 in fp32, ~0.1 in bf16).")
    sample: Optional[int] = Field(
        None, ge=0, description="nan_batch: only this row of the micro-batch (0-based) becomes NaN -- one corrupted "
        "sample in an otherwise healthy batch; default every row. On megatron (token ids) it poisons that row of "
        "the first leaf module's output, in the step's first micro-batch.")
    module: Optional[str] = Field(None, description="inf_activation, attention_collapse, sdc_compute: module path.")
    eps: Optional[float] = Field(None, gt=0, description="sdc_compute: the relative error of the module's output "
                                 "(default 1e-3).")
    factor: Optional[float] = Field(None, description="spike_batch (default 50), lr_ramp (per-step growth, "
                                    "default 1.15), attention_collapse (default 50), slow_rank (the fraction of a "
                                    "step slept, default 0.5).")
    head: int = Field(0, ge=0, description="attention_collapse: the head whose logits are scaled.")
    attempt: int = Field(0, ge=0, description="kill_rank, hang_rank: the restart attempt in which it fires.")
    during: Literal["step", "snapshot", "save"] = Field(
        "step", description="kill_rank: where the rank dies. step: at the start of `step`. snapshot: in the writer of "
        "the node-memory snapshot taken at the end of `step`, after its first file and before its commit (a node lost "
        "mid-write: that snapshot must never be chosen; needs checkpoint.snapshot.every_steps and a snapshot at `step`)."
        " save: in a disk save at `step` (trainguard's, or HF's Trainer's), its files written, before the commit.")

    @model_validator(mode="after")
    def _fields_fit_the_type(self):
        if self.param is not None and self.type not in ("inf_grad", "fp16_overflow", "nan_weights", "bitflip"):
            raise ValueError(f"'param' applies only to types 'inf_grad', 'fp16_overflow', 'nan_weights' and 'bitflip', "
                             f"not '{self.type}'")
        if self.sample is not None and self.type != "nan_batch":
            raise ValueError(f"'sample' applies only to type 'nan_batch', not '{self.type}'")
        needs_module = self.type in ("inf_activation", "attention_collapse", "sdc_compute")
        if needs_module and not self.module:
            raise ValueError(f"type '{self.type}' needs 'module' (a module path, as in model.named_modules())")
        if self.module is not None and not needs_module:
            raise ValueError(f"'module' applies only to inf_activation, attention_collapse and sdc_compute, not "
                             f"'{self.type}'")
        if self.eps is not None and self.type != "sdc_compute":
            raise ValueError(f"'eps' applies only to type 'sdc_compute', not '{self.type}'")
        if self.during != "step" and self.type != "kill_rank":
            raise ValueError(f"'during' applies only to type 'kill_rank', not '{self.type}'")
        if self.factor is not None and self.type not in ("spike_batch", "lr_ramp", "attention_collapse", "slow_rank"):
            raise ValueError(f"'factor' does not apply to type '{self.type}'")
        return self

    def factor_or_default(self) -> float:
        defaults = {"spike_batch": 50.0, "lr_ramp": 1.15, "attention_collapse": 50.0, "slow_rank": 0.5}
        return self.factor if self.factor is not None else defaults.get(self.type, 1.0)

    def active(self, step: int) -> bool:
        return self.step <= step < self.step + self.steps


class TrainguardConfig(_Section):
    """The whole block. Defaults are the ones to run production with."""

    enabled: bool = Field(True, description="false: DeepSpeed's own behaviour, unchanged.")
    detectors: DetectorsConfig = Field(default_factory=DetectorsConfig)
    clipping: ClippingConfig = Field(default_factory=ClippingConfig)
    sanitize: SanitizeConfig = Field(default_factory=SanitizeConfig)
    checks: ChecksConfig = Field(default_factory=ChecksConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    recovery: RecoveryConfig = Field(default_factory=RecoveryConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    allow_faults: bool = Field(
        False, description="Must be true for 'faults' to be accepted, so that a production config "
        "cannot carry one by accident.")
    faults: list[FaultSpec] = Field(default_factory=list, description="Faults to inject (testing only).")
    callbacks: list[str] = Field(
        default_factory=list,
        description="Your record subscribers, as 'package.module:function': each is called with every event record "
        "(the dict of a JSONL event line) on rank 0, on a background thread, never inside the training step; one "
        "that raises is logged and the run goes on. A path that does not import is a ConfigError at start. Each is "
        "imported at initialize: its code runs with the job's rights (treat the block as code); `trainguard validate` "
        "checks the block without importing them.")

    @model_validator(mode="after")
    def _faults_need_permission(self):
        if self.faults and not self.allow_faults:
            raise ValueError(FAULTS_REFUSED)
        snap, disk = self.checkpoint.snapshot, self.checkpoint.every_steps
        for f in (f for f in self.faults if f.during == "snapshot"):
            if not snap.every_steps or snap.max_overhead is None and (f.step % snap.every_steps or disk and not
                                                                       f.step % disk):
                raise ValueError(f"faults: kill_rank during 'snapshot' at step {f.step} needs a snapshot taken there: "
                                 "checkpoint.snapshot.every_steps dividing it, and no disk checkpoint at that step "
                                 "(checkpoint.every_steps), which stands in for the snapshot")
        return self


# --------------------------------------------------------------------------- parsing


def parse_block(block: Any, source: str | None = None) -> TrainguardConfig:
    """Validate the "trainguard" block itself (the dict under the key)."""
    if not isinstance(block, dict):
        raise ConfigError([(BLOCK, f"must be a JSON object (got {type(block).__name__})")], source)
    try:
        return TrainguardConfig.model_validate(block)
    except ValidationError as err:
        problems = told(err, TrainguardConfig, BLOCK, FAULTS_REFUSED)
        # pydantic skips model-level checks when a field failed; still report this one now
        if block.get("faults") and block.get("allow_faults") is not True and \
                not any(msg == FAULTS_REFUSED for _, msg in problems):
            problems.append((f"{BLOCK}.faults", FAULTS_REFUSED))
        raise ConfigError(problems, source) from None


def _reject_duplicates(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key '{k}'")
        out[k] = v
    return out


def read_json(path: str | os.PathLike) -> dict:
    """Read a ds_config file; errors name the file and the position."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError([("<file>", f"cannot read {p}: {e.strerror}")], str(p)) from None
    except UnicodeDecodeError as e:
        raise ConfigError([("<file>", f"not UTF-8 text (byte {e.start}): a JSON file is UTF-8")], str(p)) from None
    try:
        data = json.loads(text, object_pairs_hook=_reject_duplicates)
    except json.JSONDecodeError as e:
        raise ConfigError([("<file>", f"not valid JSON at line {e.lineno} column {e.colno}: {e.msg}")],
                          str(p)) from None
    except ValueError as e:
        raise ConfigError([("<file>", str(e))], str(p)) from None
    except RecursionError:
        raise ConfigError([("<file>", "nested too deeply to be a ds_config")], str(p)) from None
    if not isinstance(data, dict):
        raise ConfigError([("<file>", "the top level must be a JSON object (a ds_config)")], str(p))
    return data


def load(config: str | os.PathLike | dict | None) -> tuple[dict | None, TrainguardConfig | None]:
    """Resolve a ds_config (path or dict) into ``(ds_config_dict, block_or_None)``.

    ``None`` for the block means the config has no "trainguard" key: the caller should behave
    exactly as plain DeepSpeed.
    """
    if config is None:
        return None, None
    source = None
    if isinstance(config, (str, os.PathLike)):
        source = str(config)
        config = read_json(config)
    if not isinstance(config, dict):
        raise ConfigError([("<config>", f"expected a path or a dict, got {type(config).__name__}")])
    if BLOCK not in config:
        return config, None
    return config, parse_block(config[BLOCK], source)


def block_of(config: Any, caller: str = "trainguard") -> TrainguardConfig:
    """The block, for an API that takes it alone (megatron_hooks.install): a parsed config, a dict, or a JSON
    file -- the block itself, or a ds_config-style one holding a "trainguard" key."""
    if isinstance(config, TrainguardConfig):
        return config
    source = None
    if isinstance(config, (str, os.PathLike)):
        source, config = str(config), read_json(config)
    if not isinstance(config, dict):
        raise TypeError(f"{caller}: config must be a path, a dict or a TrainguardConfig, not {type(config).__name__}")
    return parse_block(config.get(BLOCK, config), source)


def config_hash(cfg: TrainguardConfig) -> str:
    """The block's fingerprint (a checkpoint's lineage, the run_start record): sha256 of its canonical JSON, 16 hex."""
    import hashlib

    text = json.dumps(cfg.model_dump(mode="json"), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
