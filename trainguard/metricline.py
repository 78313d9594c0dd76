"""The metric line of a step, written one step late.

The framework's global gradient norm of a step is a device tensor when the step ends; reading it
then would cost a second host synchronisation. It rides instead in the *next* step's AGREE table
(``prev_grad_norm``), so the line waits here until that table arrives (or the run closes, where
the one read is paid). The clipper learns the norm at the same moment.

The norm of the gradients the step applied (after the framework's clipping, measured by
:class:`trainguard.appliedgrad.AppliedGradMeter` on the steps whose line is written) rides in the
same table (``prev_applied_sq``, summed over ranks): the line's ``grad_norm_clipped``.
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
        self.applied_sq: Any = None  # this rank's squared norm of what the held step applied (device tensor)

    def hold(self, step: int, line: dict, rank_line: dict | None, due: bool, limit: float | None, applied: bool,
             norm: Any, applied_sq: Any = None) -> None:
        self._held = {"step": step, "line": line, "rank_line": rank_line, "due": due, "limit": limit,
                      "applied": applied}
        self.norm = norm
        self.applied_sq = applied_sq

    def flush(self, norm: float, applied_sq: float | None = None) -> None:
        """Write the held line with its norm and the global squared norm of what it applied (host
        floats, read from the AGREE table; ``applied_sq`` None or NaN: not measured)."""
        held, self._held, self.norm, self.applied_sq = self._held, None, None, None
        if held is None:
            return
        applied = held["applied"]
        norm = norm if applied and math.isfinite(norm) else None
        limit = held["limit"] if held["limit"] is not None else self.clipper.framework_max_norm
        if applied:
            self.clipper.observe(norm, limit)
        measured = math.sqrt(applied_sq) if applied and applied_sq is not None and math.isfinite(applied_sq) \
            else None
        line = dict(held["line"], grad_norm=norm, grad_norm_clipped=measured, clip_limit=limit if limit else None)
        if held["due"]:
            self.events.metric(held["step"], line, held["rank_line"])

    def close(self, world: int = 1) -> None:
        """At CLOSE: the last line, with the one host read of its norm. What it applied is a sum over
        ranks that no table brings any more: measured on a single rank only."""
        if self._held is not None:
            sq = float(self.applied_sq) if world == 1 and self.applied_sq is not None else None
            self.flush(float(self.norm) if self.norm is not None else float("nan"), sq)
