"""The block's ``recovery`` section (trainguard.config): the ladders per anomaly class, their rungs, the budgets."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from trainguard.config.base import _Section


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
        "for lr_cooldown_steps -- for a slow_rise in place, nothing loaded, where the loop's count goes on "
        "through a rollback (Megatron-LM's --train-iters, HF Trainer's max_steps) and going back would throw away "
        "more steps than the run has left, to a checkpoint whose loss was no lower than now. loss_scale (the fp16 scaler collapsed) also takes raise_floor (roll back, reset "
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
        "before the jump; else, for a slow_rise that began young (within twice the LR's first rise -- its warmup --, "
        "or twice the steps the loss trend takes to speak in a run without one: min_history + 4 x smooth + "
        "patience), a tenth of the LR at the loss's "
        "best and a restart from the first step's checkpoint (checkpoint.first_step), once per run -- not where the "
        "loop's count goes on through a rollback and the restart would throw away more steps than the run has left "
        "(Megatron-LM's --train-iters, HF Trainer's max_steps): lr_factor then; else lr_factor. "
        "Never less of a cut than lr_factor; never below lr_floor (held there once). factor: always lr_factor. "
        "evidence also sizes a young run's bf16 fallback (fp16_fallback) whose loss climbed above where it began before "
        "the loss trend could speak (its last `smooth` losses all above the median of its first three by rise and by "
        "noise_z spreads): a start-over from the first step with a tenth of the LR where the loss was lowest, for the "
        "rest of the run.")
    lr_cooldown_steps: int = Field(1000, ge=1, description="How long the lowered LR lasts (a cut lr_cut: evidence "
                                   "sized from a jump or a young run lasts the rest of the run: the schedule's own LR "
                                   "failed, and back it would fail again).")
    lr_floor: float = Field(0.01, gt=0, le=1, description="Abort when the accumulated LR factor would go below "
                            "this (lowering it further is not a remedy any more). 0.01: six halvings; a peak LR "
                            "30x too high (bench/natural) needs five.")
    reset_optimizer_moments: bool = Field(False, description="On a rollback, zero Adam's moment estimates (as SPAM "
                                          "does) instead of keeping the checkpoint's.")
    max_rollbacks: int = Field(5, ge=0, description="Rollbacks allowed within rollback_window steps (then: when_exhausted).")
    rollback_window: int = Field(1000, ge=1, description="Window of the rollback budget, in steps.")
    when_exhausted: Literal["train_on", "abort"] = Field(
        "train_on", description="When max_rollbacks or lr_floor is spent: train_on -- go on as the framework would, "
        "alerts only (a non-finite step still skipped; a recovery never ends a run its framework would have "
        "finished) --, or abort on every rank with the report of what was tried.")
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
