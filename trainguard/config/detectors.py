"""The block's ``detectors`` sections (trainguard.config): what each detector watches and when it speaks."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from trainguard.config.base import PluginSpec, _Section


class NonfiniteConfig(_Section):
    """Non-finite loss and gradients, checked on each rank's local values."""

    enabled: bool = Field(True, description="Check every step's local loss and local gradients for NaN/Inf.")
    check_grads: bool = Field(
        True,
        description="Also check each rank's local gradients, before the data-parallel reduction (where the "
        "framework reduces them: one multi-tensor norm a bucket; ZeRO-3: a tensor hook per parameter). Off: only the "
        "loss is checked.")
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
    min_regain: float = Field(0.1, ge=0, le=1, description="... and only when the loss stands this fraction of what "
                              "the run has learnt above the median: (loss - median) >= min_regain x (first level - "
                              "median), the first level being the median of the first 5 losses. A loss near "
                              "its floor has a tail of single hard samples that is its own noise, where a bad batch "
                              "scores near the first level (0: off).")


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
    noise_z: float = Field(3.0, ge=0, description="The band is also at least this many robust spreads of the raw "
                           "loss (1.4826 x MAD of the window that set the best) above the best: a rise the loss's own "
                           "noise makes is no climb (0: off).")
    min_regain: float = Field(0.05, ge=0, le=1, description="... and at least this fraction of what the loss has "
                              "fallen from its first level (the median of its first `smooth` losses) to its best: a relative rise "
                              "on a loss near its floor is noise, a divergence gives back what was learnt (0: off).")
    @property
    def settle(self) -> int:
        """The steps the trend takes to speak: its history, the window its level needs, its patience (what "young"
        and a stall are measured in: trainguard.recovery.lrcut, trainguard.detectors.loss_trend)."""
        return self.min_history + 4 * self.smooth + self.patience

    stall_fall: float = Field(0.2, ge=0, lt=1, description="A stalled start: a fresh run that reached its LR's peak within "
                              "the trend's settling time (min_history + 4 x smooth + patience steps) and whose loss has not "
                              "fallen this fraction below where it began once it held that peak as long (judged until "
                              "twice that) ... (0: off)")
    stall_grad_drop: float = Field(4.0, gt=1, description="... while its gradient norm fell to 1/this of its first "
                                   "level (at its lowest since): the peak LR broke the model, it learns nothing (the model moved, its loss did "
                                   "not). A slow_rise from the LR's peak: a young run's restart with a tenth of that LR. "
                                   "A fine-tune that starts low keeps its gradient norm; a run that learns brings its loss down.")


class GradNormConfig(_Section):
    """Gradient-norm surge (one-step jump) and sustained rise (the precursor of an explosion)."""

    enabled: bool = Field(True, description="Watch the RMS of the ranks' local gradient norms.")
    window: int = Field(128, ge=8, description="Healthy steps kept for the median and MAD.")
    z: float = Field(6.0, gt=0, description="Surge when (norm - median) / MAD exceeds this (counted "
                   "toward surges_to_rise); alerted as grad_surge when log(norm / median) over the MAD of the window's "
                   "log norms exceeds it too (a ratio's deviation: the norm's noise scales with it).")
    min_history: int = Field(20, ge=3, description="Steps observed before any alert.")
    trend_steps: int = Field(12, ge=3, description="Steps over which a sustained rise is measured.")
    trend_rise: float = Field(
        0.03, gt=0, description="Rise alert when log(norm) grows faster than this per step (least squares) "
        "over trend_steps, all above the median. 0.03/step = +43% over 12 steps.")
    surges_to_rise: int = Field(3, ge=0, description="This many surges (z past `z`) within surge_window steps, while "
                                "the loss stands 5% above its best level (detectors.loss_trend), are a slow_rise (an "
                                "irregular surge never gives a clean log-slope; a bad batch's surge does not count; "
                                "0: never).")
    surge_window: int = Field(50, ge=2, description="Steps over which surges are counted.")


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
        0.995, gt=0, le=1, description="Alert when a head that had focused (below focused_below at a sample) is back "
        "above this fraction of its maximum entropy (uniform attention: it stopped attending), once the run is past "
        "min_step. A head that never focused is no change (heads start uniform; a small model keeps some so).")
    focused_below: float = Field(0.9, gt=0, le=1, description="A head counts as having focused once its entropy was "
                                 "below this fraction of its maximum at a sample.")
    min_step: int = Field(0, ge=0, description="No saturation alerts before this step.")


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
