"""The block's sections on what the training step is fed and how its gradients are bounded (trainguard.config):
``clipping``, ``sanitize`` and ``data``."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from trainguard.config.base import _Section


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
    exceed_framework_clip: bool = Field(
        False, description="adaptive: may the limit rise above the clip your framework is configured with (DeepSpeed's "
        "gradient_clipping, Megatron's --clip-grad)? false: it only ever tightens it -- a healthy run's norms put the "
        "EMA's limit above a clip of 1.0, which loosened what you asked for.")


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


class DataConfig(_Section):
    """The loader handed back when ``training_data`` is given."""

    shuffle: bool = Field(True, description="Shuffle each epoch (a permutation seeded by seed + epoch).")
    seed: int = Field(0, description="Seed of the per-epoch permutation; identical on every rank.")
    drop_last: bool = Field(
        True, description="Drop the tail that does not fill a micro-batch on every data-parallel rank.")
