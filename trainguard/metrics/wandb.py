"""Weights & Biases mirror of the JSONL log (rank 0). Needs ``wandb`` (``pip install wandb``).

wandb's own environment applies as usual (``WANDB_API_KEY``, ``WANDB_MODE=offline``,
``WANDB_DIR``, ...); the block's ``metrics.wandb`` names the project and, optionally, the run, the
directory and the mode. W&B's step must only grow, and a rollback sends trainguard's step back:
every row therefore carries ``trainguard/step`` (the optimizer step, which may repeat after a
rollback), and the charts use it as their x axis; W&B's own step just counts rows.
"""
from __future__ import annotations

import math
from typing import Any

from trainguard.errors import TrainguardError


def _scalars(values: dict[str, Any], prefix: str = "trainguard/") -> dict[str, float]:
    out = {}
    for key, v in values.items():
        if isinstance(v, bool):
            out[prefix + key] = float(v)
        elif isinstance(v, (int, float)) and math.isfinite(v):
            out[prefix + key] = v
    return out


class WandbSink:
    def __init__(self, cfg, run_config: dict | None = None):
        try:
            import wandb
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise TrainguardError(f"trainguard.metrics.wandb needs the wandb package: pip install wandb, or trainguard's "
                                  f"[wandb] extra ({e})") from None
        kwargs = {"project": cfg.project, "name": cfg.name, "dir": cfg.dir, "config": run_config or {}}
        if cfg.mode is not None:
            kwargs["mode"] = cfg.mode
        self.run = wandb.init(**{k: v for k, v in kwargs.items() if v is not None})
        self.run.define_metric("trainguard/step")
        self.run.define_metric("trainguard/*", step_metric="trainguard/step")
        self.counts: dict[str, int] = {}

    def metric(self, step: int, values: dict[str, Any]) -> None:
        row = _scalars(values)
        for layer, ratios in (values.get("attention_entropy_ratio") or {}).items():
            if ratios:
                row[f"trainguard/attention_entropy_ratio_min/{layer}"] = min(ratios)
        row["trainguard/step"] = step
        self.run.log(row)

    def event(self, step: int, event: str, ranks, action, detail) -> None:
        """Each record as a running count per type (a chart of when they happened)."""
        self.counts[event] = self.counts.get(event, 0) + 1
        self.run.log({f"trainguard/events/{event}": self.counts[event], "trainguard/step": step})

    def close(self) -> None:
        self.run.finish()
