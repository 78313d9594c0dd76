"""TensorBoard scalars mirroring the JSONL metric lines (rank 0). Needs ``tensorboard``
(``pip install tensorboard``, or trainguard's ``[monitor]`` extra)."""
from __future__ import annotations

import math
from typing import Any

from trainguard.errors import TrainguardError


class TensorBoardSink:
    def __init__(self, logdir: str):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise TrainguardError("trainguard.metrics.tensorboard needs the tensorboard package: "
                                  f"pip install tensorboard (or trainguard's [monitor] extra) ({e})") from None
        self.writer = SummaryWriter(logdir)

    def metric(self, step: int, values: dict[str, Any]) -> None:
        for key, v in values.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                continue
            self.writer.add_scalar(f"trainguard/{key}", v, step)
        for layer, ratios in (values.get("attention_entropy_ratio") or {}).items():
            for head, r in enumerate(ratios):
                self.writer.add_scalar(f"trainguard/attention_entropy_ratio/{layer}/head{head}", r, step)

    def event(self, step: int, event: str, ranks, action, detail) -> None:
        self.writer.add_text("trainguard/events", f"step {step}: {event} on ranks {list(ranks)} -> {action}", step)

    def close(self) -> None:
        self.writer.close()
