"""The metric line of a step, written one step late.

The framework's global gradient norm of a step is a device tensor when the step ends; reading it
then would cost a second host synchronisation. It rides instead in the *next* step's AGREE table
(``prev_grad_norm``), so the line waits here until that table arrives (or the run closes, where
the one read is paid). The clipper learns the norm at the same moment.
"""
from __future__ import annotations

import math
from typing import Any


class DeferredLine:
    def __init__(self, events, clipper):
        self.events = events      # trainguard.eventlog.EventLog
        self.clipper = clipper    # trainguard.clipping.Clipper
        self._held: dict | None = None
        self.norm: Any = None     # the held step's framework norm (maybe a device tensor)

    def hold(self, step: int, line: dict, rank_line: dict | None, due: bool, limit: float | None, applied: bool,
             norm: Any) -> None:
        self._held = {"step": step, "line": line, "rank_line": rank_line, "due": due, "limit": limit,
                      "applied": applied}
        self.norm = norm

    def flush(self, norm: float) -> None:
        """Write the held line with its norm (a host float, read from the AGREE table)."""
        held, self._held, self.norm = self._held, None, None
        if held is None:
            return
        applied = held["applied"]
        norm = norm if applied and math.isfinite(norm) else None
        limit = held["limit"] if held["limit"] is not None else self.clipper.framework_max_norm
        if applied:
            self.clipper.observe(norm, limit)
        line = dict(held["line"], grad_norm=norm, grad_norm_clipped=self.clipper.clipped(norm, limit),
                    clip_limit=limit if limit else None)
        if held["due"]:
            self.events.metric(held["step"], line, held["rank_line"])

    def close(self) -> None:
        """At CLOSE: the last line, with the one host read of its norm."""
        if self._held is not None:
            self.flush(float(self.norm) if self.norm is not None else float("nan"))
