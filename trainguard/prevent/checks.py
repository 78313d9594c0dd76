"""Start-of-run checks (prevent): one warning each, from facts the adapter reads off the framework."""
from __future__ import annotations

from dataclasses import dataclass

from trainguard.config import TrainguardConfig
from trainguard.verdicts import Verdict


@dataclass(frozen=True)
class RunFacts:
    dtype: str                      # "fp32" | "bf16" | "fp16"
    bf16_supported: bool
    warmup_steps: int | None        # None: no warmup found; -1: a scheduler we cannot inspect
    scheduler: str | None
    framework_clip: float           # the framework's own gradient clipping (0: off)
    last_step: int | None = None    # the loop's last step where its count goes on through a rollback (Megatron-LM's
    #                                 train_iters, HF Trainer's max_steps); None: unknown, or it rewinds with the weights


def start_checks(facts: RunFacts, cfg: TrainguardConfig, replicas: int | None = None) -> list[Verdict]:
    """``replicas``: the data-parallel size (None: unknown) -- what a check needs a second replica for is said off."""
    out = []
    if replicas == 1:  # (said whatever checks.enabled: it is what the block switched on, not advice)
        for key, on in (("detectors.replica_check", cfg.detectors.replica_check.enabled),
                        ("detectors.peer_replay", cfg.detectors.peer_replay.enabled)):
            if on:
                out.append(Verdict("checks", "off_at_this_layout", (), {
                    "key": key, "replicas": 1,
                    "why": "one data-parallel replica: no other replica holds the same weights to compare with",
                    "advice": f"it does nothing in this run; {key}.enabled: false says so in your block"}))
    if not cfg.checks.enabled:
        return out
    if facts.dtype == "fp16" and facts.bf16_supported:
        out.append(Verdict("checks", "fp16_where_bf16", (), {
            "advice": "bf16 is available here: it has fp32's exponent range, so softmax and layer-norm "
                      "intermediates cannot overflow to Inf the way fp16's (max 65504) do; use \"bf16\"."}))
    if facts.warmup_steps is None or 0 <= facts.warmup_steps <= 1 < cfg.checks.min_warmup_steps:  # (one is none:
        # HF's warmup_steps 0, as it fills DeepSpeed's WarmupDecayLR, read "the LR warmup (1 steps) is shorter than")
        out.append(Verdict("checks", "no_warmup", (), {
            "scheduler": facts.scheduler, **({"warmup_steps": facts.warmup_steps} if facts.warmup_steps else {}),
            "advice": "no LR warmup is configured: the first steps of Adam with a full LR are a classic "
                      "cause of early loss spikes; use a warmup (Megatron-LM: --lr-warmup-iters; DeepSpeed: WarmupLR "
                      "/ WarmupDecayLR; HF: warmup_steps)."}))
    elif facts.warmup_steps >= 0 and facts.warmup_steps < cfg.checks.min_warmup_steps:
        out.append(Verdict("checks", "short_warmup", (), {
            "warmup_steps": facts.warmup_steps, "min_warmup_steps": cfg.checks.min_warmup_steps,
            "advice": f"the LR warmup ({facts.warmup_steps} steps) is shorter than trainguard.checks.min_warmup_steps "
                      f"({cfg.checks.min_warmup_steps}): lengthen it (Megatron-LM: --lr-warmup-iters; DeepSpeed: the "
                      "scheduler's warmup_num_steps; HF: warmup_steps), or lower that key if this warmup is your "
                      "choice."}))
    if facts.framework_clip <= 0 and cfg.clipping.mode == "deepspeed":
        out.append(Verdict("checks", "no_clipping", (), {
            "advice": "gradient clipping is off: set \"gradient_clipping\" (e.g. 1.0) or "
                      "trainguard.clipping.mode to \"norm\" or \"adaptive\"."}))
    return out


def bf16_supported() -> bool:
    """Whether this machine runs bf16 well: the GPU's answer, or True on a CPU (its kernels run bf16)."""
    import torch

    if torch.cuda.is_available():
        try:
            return bool(torch.cuda.is_bf16_supported())
        except (RuntimeError, AssertionError, AttributeError):
            return False
    return True

