"""The block's ``faults`` (trainguard.config): one injected fault each, refused unless ``allow_faults``."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from trainguard.config.base import _Section

FAULTS_REFUSED = ("faults are listed but 'allow_faults' is not true; fault injection is refused in a "
                  "config that does not opt in")
FAULT_TYPES = ("nan_loss", "inf_grad", "nan_batch", "spike_batch", "lr_ramp", "inf_activation",
               "attention_collapse", "bad_label")


class FaultSpec(_Section):
    """One injected fault. Used by tests, the demo and fire drills; refused unless allow_faults."""

    type: Literal["nan_loss", "inf_grad", "nan_batch", "spike_batch", "lr_ramp", "inf_activation",
                  "attention_collapse", "bad_label", "fp16_overflow", "corrupt_checkpoint", "kill_rank",
                  "hang_rank", "checkpoint_write_error", "slow_rank", "nan_weights", "bitflip", "sdc_compute",
                  "force_action"] = Field(
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
        "that rank -- training and replays alike: it stands for a device that computes wrong (finite, silent). "
        "force_action: at `step`, on every rank, the step's decision becomes `action` (what the policy could decide, "
        "forced where no detector would: recovery fuzzing -- bench/recovery_fuzz.py -- and drills of a recovery path "
        "in the states a run really reaches); once, like every fault: a rollback that re-runs the step does not force "
        "it again.")
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
    action: Optional[Literal["skip", "rollback", "rollback_newest", "rollback_stable", "restart", "lr_cut",
                             "bf16_fallback"]] = Field(
        None, description="force_action: the decision forced. skip: the step is skipped. rollback: to the target "
        "recovery.rollback_to names; rollback_newest / rollback_stable: to that target. restart: to the first step's "
        "checkpoint with the LR cut (recovery.lr_factor). lr_cut: a rollback with the LR cut. bf16_fallback: the "
        "loss_scale ladder's top rung (a rollback, then bf16; an fp16 run only).")
    module: Optional[str] = Field(None, description="inf_activation, attention_collapse, sdc_compute: module path.")
    eps: Optional[float] = Field(None, gt=0, description="sdc_compute: the relative error of the module's output "
                                 "(default 1e-3).")
    factor: Optional[float] = Field(None, description="spike_batch (default 50), lr_ramp (per-step growth, "
                                    "default 1.15), attention_collapse (default 50), slow_rank (the fraction of a "
                                    "step slept, default 0.5).")
    head: int = Field(0, ge=0, description="attention_collapse: the head whose logits are scaled.")
    attempt: int = Field(0, ge=0, description="kill_rank, hang_rank: the restart attempt in which it fires.")
    generation: int = Field(0, ge=0, description="kill_rank, hang_rank: the generation of a supervised world "
                            "(trainguard.supervise) in which it fires: 0, the ranks launched; 1, the world after the "
                            "first replacement (its spare included) -- a spare that dies after taking a rank.")
    during: Literal["step", "snapshot", "save", "rollback"] = Field(
        "step", description="kill_rank: where the rank dies. step: at the start of `step`. snapshot: in the writer of "
        "the node-memory snapshot taken at the end of `step`, after its first file and before its commit (a node lost "
        "mid-write: that snapshot must never be chosen; needs checkpoint.snapshot.every_steps and a snapshot at `step`)."
        " save: in a disk save at `step` (trainguard's, or HF's Trainer's), its files written, before the commit. "
        "rollback: in a rollback's load at `step`, before the framework's load (a node lost mid-recovery).")

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
        if self.generation and self.type not in ("kill_rank", "hang_rank"):
            raise ValueError(f"'generation' applies only to types 'kill_rank' and 'hang_rank', not '{self.type}'")
        if self.during != "step" and self.type != "kill_rank":
            raise ValueError(f"'during' applies only to type 'kill_rank', not '{self.type}'")
        if (self.action is None) == (self.type == "force_action"):
            raise ValueError("type 'force_action' needs 'action'" if self.action is None else
                             f"'action' applies only to type 'force_action', not '{self.type}'")
        if self.factor is not None and self.type not in ("spike_batch", "lr_ramp", "attention_collapse", "slow_rank"):
            raise ValueError(f"'factor' does not apply to type '{self.type}'")
        return self

    def factor_or_default(self) -> float:
        defaults = {"spike_batch": 50.0, "lr_ramp": 1.15, "attention_collapse": 50.0, "slow_rank": 0.5}
        return self.factor if self.factor is not None else defaults.get(self.type, 1.0)

    def active(self, step: int) -> bool:
        return self.step <= step < self.step + self.steps
