"""The metric line of a step, written one step late.

The framework's global gradient norm of a step is a device tensor when the step ends; reading it
then would cost a second host synchronisation. It rides instead in the *next* step's AGREE table
(``prev_grad_norm``), so the line waits here until that table arrives (or the run closes, where
the one read is paid). The clipper learns the norm at the same moment.

The norm of the gradients the step applied (after the framework's clipping, measured by
:class:`trainguard.step.appliedgrad.AppliedGradMeter` on the steps whose line is written) rides in the
same table (``prev_applied_sq``, summed over ranks): the line's ``grad_norm_clipped``.
"""
from __future__ import annotations

import math
from typing import Any

import torch


def step_line(view, metrics: dict, loss_median: float | None, guard_skipped: int, straggler_ratio: dict | None,
              probes: dict) -> dict:
    """Rank 0's metric line of a step (before its framework norm arrives): the mean loss over the ranks that
    have one (NaN when any is not finite), every rank's local loss, norm, clock and compute time -- or, where
    the step's rows did not travel (``view``: trainguard.step.agreement.StepView; above 64 ranks), their extremes
    with the rank that holds each --, the straggler ratios, and the sampled probes' values merged over ranks
    (their extremes) and by rank."""
    s = view.summary
    line = {"loss": s.loss_mean, "loss_median": loss_median, **metrics, "guard_skipped_steps": guard_skipped}
    if view.full:
        obs = list(view)
        with_loss = [o for o in obs if o.has_loss]
        finite = [o.loss for o in with_loss if math.isfinite(o.loss)]
        line["loss"] = (sum(finite) / len(finite)) if len(finite) == len(with_loss) and finite else float("nan")
        line.update({"local_losses": [o.loss for o in obs], "local_grad_norms": [o.grad_norm for o in obs],
                     "clocks": [o.clock for o in obs], "compute_s": [o.compute_s for o in obs]})
        if straggler_ratio:
            line["straggler_ratio"] = [straggler_ratio.get(o.rank) for o in obs]
    else:
        line.update({"local_loss_max": s.loss_max.as_list(), "local_grad_norm_max": s.grad_norm_max.as_list(),
                     "compute_s_max": s.compute_max.as_list(), "compute_s_min": s.compute_min.as_list(),
                     "compute_s_mean": s.compute_mean, "clock_min": s.clock_min.as_list(),
                     "clock_max": s.clock_max.as_list()})
        if straggler_ratio:
            line["straggler_ratio_by_rank"] = {str(r): v for r, v in sorted(straggler_ratio.items())}
    if probes.get("entropy"):  # {rank: {layer: {"ratio": [per head], "entropy": [...]}}}
        ent = probes["entropy"]
        line["attention_entropy_ratio"] = merged(ent, lambda v: v["ratio"], min)
        line["attention_entropy"] = merged(ent, lambda v: v["entropy"], min)
        line["attention_entropy_ratio_by_rank"] = {str(r): {k: v["ratio"] for k, v in layers.items()}
                                                   for r, layers in ent.items()}
    if probes.get("activation"):  # {rank: {module: (max_abs, rms)}}
        act = probes["activation"]
        line["activation_max_abs"] = merged(act, lambda v: v[0], max)
        line["activation_rms"] = merged(act, lambda v: v[1], max)
        line["activation_max_abs_by_rank"] = {str(r): {k: v[0] for k, v in mods.items()} for r, mods in act.items()}
    return line


def merged(per_rank: dict[int, dict], pick, fold) -> dict:
    """One value per key (per head, for lists) over the ranks that have it: the extreme one (``fold``:
    min for entropy, max for activations), so that what any rank saw shows in the line."""
    out: dict = {}
    for values in per_rank.values():
        for key, v in values.items():
            v = pick(v)
            if key not in out:
                out[key] = list(v) if isinstance(v, (list, tuple)) else v
            elif isinstance(v, (list, tuple)):
                out[key] = [b if a is None else a if b is None else fold(a, b) for a, b in zip(out[key], v)]
            elif v is not None:
                out[key] = v if out[key] is None else fold(out[key], v)
    return out


class DeferredLine:
    def __init__(self, events, clipper):
        self.events = events      # trainguard.observe.eventlog.EventLog
        self.clipper = clipper    # trainguard.prevent.clipping.Clipper
        self._held: dict | None = None
        self.norm: Any = None     # the held step's framework norm (maybe a device tensor)
        self.applied_sq: Any = None  # this rank's squared norm of what the held step applied (device tensor)

    def hold(self, step: int, line: dict, rank_line: dict | None, due: bool, applied: bool, grad_norm: Any = None,
             clip_limit: float | None = None, applied_grad_sq: Any = None) -> None:
        """A step's line until its norms arrive: the framework's global norm (``grad_norm``, maybe a device
        tensor), the limit it clipped at, this rank's squared norm of what the step applied (a device tensor)."""
        self._held = {"step": step, "line": line, "rank_line": rank_line, "due": due, "limit": clip_limit,
                      "applied": applied}
        # (as the next row takes them: float64 device scalars, converted now, after this step's launch)
        self.norm = grad_norm.detach().reshape(()).to(torch.float64) if isinstance(grad_norm, torch.Tensor) else \
            grad_norm
        self.applied_sq = applied_grad_sq.detach().reshape(()).to(torch.float64) \
            if isinstance(applied_grad_sq, torch.Tensor) else applied_grad_sq

    def flushed(self, view):
        """``view`` (an AGREE StepView), after the held line was written with the norms it brought."""
        self.flush(view.summary.prev_grad_norm, view.summary.prev_applied_sq)
        return view

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
        self.events.first_step(held["step"])  # (a new run's earlier log set aside: before its first line)
        if held["due"]:
            self.events.metric(held["step"], line, held["rank_line"])

    def close(self, world: int = 1) -> None:
        """At CLOSE: the last line, with the one host read of its norm. What it applied is a sum over
        ranks that no table brings any more: measured on a single rank only."""
        if self._held is not None:
            sq = float(self.applied_sq) if world == 1 and self.applied_sq is not None else None
            self.flush(float(self.norm) if self.norm is not None else float("nan"), sq)
