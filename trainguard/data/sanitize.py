"""Batch sanitising (prevent): check every sample before it reaches the model.

Runs in the loader on the host, on the samples as the dataset returns them: no device work, no
synchronisation. Each check is cheap and only runs when configured: sequence length cap, token ids
and labels within ``[0, vocab_size)`` (an out-of-range label makes cross-entropy NaN, or crashes
it), all-pad and all-zero sequences.
"""
from __future__ import annotations

from typing import Any

import torch

from trainguard.config import SanitizeConfig
from trainguard.errors import TrainguardError


class SanitizeError(TrainguardError):
    """``sanitize.action`` is "fail" and a sample failed a check."""

    def __init__(self, rejected: list[tuple[int, list[str]]], rank: int):
        self.rejected = rejected
        lines = [f"  sample {i}: {'; '.join(p)}" for i, p in rejected]
        super().__init__(f"rank {rank}: {len(rejected)} sample(s) failed trainguard.sanitize checks:\n"
                         + "\n".join(lines) + "\nFix or remove them, or set trainguard.sanitize.action to "
                         "'drop_sample' or 'quarantine_batch'.")


def _tokens(sample: Any, key: str) -> torch.Tensor | None:
    if isinstance(sample, dict):
        v = sample.get(key)
    elif isinstance(sample, torch.Tensor):
        v = sample
    else:
        return None
    return torch.as_tensor(v) if v is not None else None


def check_sample(sample: Any, cfg: SanitizeConfig) -> list[str]:
    """The problems with one sample (empty when it is clean)."""
    problems = []
    ids = _tokens(sample, cfg.input_key)
    if ids is not None and ids.numel():
        if cfg.max_seq_len is not None and ids.shape[-1] > cfg.max_seq_len:
            problems.append(f"length {ids.shape[-1]} > max_seq_len {cfg.max_seq_len}")
        if cfg.vocab_size is not None and not ids.is_floating_point():
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= cfg.vocab_size:
                problems.append(f"token id {lo if lo < 0 else hi} outside [0, {cfg.vocab_size})")
        if cfg.pad_id is not None and bool((ids == cfg.pad_id).all()):
            problems.append(f"all tokens are pad_id {cfg.pad_id}")
        elif cfg.reject_all_zero and not bool(ids.any()):
            problems.append("all-zero sequence")
    labels = _tokens(sample, cfg.label_key) if isinstance(sample, dict) else None
    if labels is not None and labels.numel() and cfg.vocab_size is not None and not labels.is_floating_point():
        valid = labels[labels != cfg.ignore_index]
        if valid.numel():
            lo, hi = int(valid.min()), int(valid.max())
            if lo < 0 or hi >= cfg.vocab_size:
                problems.append(f"label {lo if lo < 0 else hi} outside [0, {cfg.vocab_size}) "
                                f"(ignore_index {cfg.ignore_index} allowed)")
    return problems


def sanitize(ids: list[int], samples: list, cfg: SanitizeConfig, rank: int = 0):
    """Apply the checks and the action. Returns ``(kept_ids, kept_samples, rejected)`` where
    ``rejected`` is ``[(sample_id, problems)]``; ``kept_*`` are empty when the batch is quarantined."""
    rejected = []
    keep = []
    for i, s in zip(ids, samples):
        p = check_sample(s, cfg)
        (rejected.append((i, p)) if p else keep.append((i, s)))
    if not rejected:
        return ids, samples, []
    if cfg.action == "fail":
        raise SanitizeError(rejected, rank)
    if cfg.action == "quarantine_batch":  # the clean samples go aside with their batch
        bad = {i for i, _ in rejected}
        return [], [], rejected + [(i, ["quarantined with its batch"]) for i in ids if i not in bad]
    return [i for i, _ in keep], [s for _, s in keep], rejected


def active(cfg: SanitizeConfig) -> bool:
    """Whether any check is configured (else the loader skips the sanitiser altogether)."""
    return cfg.enabled and (cfg.reject_all_zero or
                            any(x is not None for x in (cfg.max_seq_len, cfg.vocab_size, cfg.pad_id)))
