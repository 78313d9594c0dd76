"""Stragglers: a rank that is alive but slow holds every collective back. Pure: each step, every
rank's own compute time (``RankObservation.compute_s``, from the AGREE table: no extra sync) over
the median rank's; a rank whose median ratio over the last ``window`` steps exceeds ``slower_by``
is named -- once per episode, with how much slower and for how long. Noise on a busy machine moves
single steps, not a window's median. Above 64 ranks, where every rank's time does not travel each step, the
same rule runs on the step's slowest rank against the mean (:meth:`StragglerDetector.observe_reduced`).
"""
from __future__ import annotations

import math
from collections import deque

from trainguard.config import StragglerConfig
from trainguard.verdicts import RankObservation, Verdict


def _median(xs):
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


class StragglerDetector:
    def __init__(self, cfg: StragglerConfig):
        self.cfg = cfg
        self.ratios: dict[int, deque] = {}
        self.since: dict[int, int] = {}      # rank -> first step of its current slow episode
        self.named: set[int] = set()         # ranks reported in their current episode
        self.last: dict[int, float] = {}     # rank -> its window's median ratio (for the metrics)
        self._slowest: deque = deque(maxlen=cfg.window)  # (rank, ratio to the mean) of each step: the reduced view

    def observe(self, step: int, obs: list[RankObservation]) -> list[Verdict]:
        times = [o.compute_s for o in obs]
        if len(obs) < 2 or not all(isinstance(t, float) and math.isfinite(t) and t >= 0 for t in times):
            return []
        mid = _median(times)
        if mid < self.cfg.min_step_s:
            return []
        out = []
        for o in obs:
            window = self.ratios.setdefault(o.rank, deque(maxlen=self.cfg.window))
            window.append(o.compute_s / mid if mid > 0 else 1.0)
            if len(window) < self.cfg.window:
                continue
            found, _ = self._episode(step, o.rank, _median(window),
                                     {"compute_s": round(o.compute_s, 6), "median_rank_s": round(mid, 6)})
            out += [found] if found else []
        return out

    def _episode(self, step: int, rank: int, ratio: float, measured: dict, after: dict | None = None):
        """One rank's windowed ratio against ``slower_by`` (both views): ``(verdict, over)`` -- a verdict when it
        opens the rank's episode (once per episode), ``over`` when the episode ended (hysteresis)."""
        self.last[rank] = ratio
        if ratio > self.cfg.slower_by:
            first = self.since.setdefault(rank, step - self.cfg.window + 1)
            if rank in self.named:
                return None, False
            self.named.add(rank)
            return Verdict("straggler", "straggler", (rank,), {
                "slower_by": round(ratio, 3), **measured, "since_step": first, "for_steps": step - first + 1,
                "window": self.cfg.window, "limit": self.cfg.slower_by, **(after or {})}), False
        if ratio < 1.0 + (self.cfg.slower_by - 1.0) / 2:  # (hysteresis: the episode is over)
            self.since.pop(rank, None)
            self.named.discard(rank)
            return None, True
        return None, False

    def observe_reduced(self, step: int, summary) -> list[Verdict]:
        """Above 64 ranks the rows do not travel on a healthy step (trainguard.step.agreement): each step brings the
        slowest rank and the mean time over the ranks (``summary``: trainguard.ranks.reduced.Summary). A rank's window
        then holds its ratio to the mean on the steps it was the slowest and 1.0 on the others, so a rank is named
        when it was the slowest in more than half the window by more than ``slower_by`` (its window's median). Two
        stragglers at once: the slower is named first; the other once the first is gone."""
        mid, slow = summary.compute_mean, summary.compute_max
        if summary.world < 2 or mid is None or slow.rank is None or mid < self.cfg.min_step_s:
            return []
        self._slowest.append((slow.rank, slow.value / mid if mid > 0 else 1.0))
        out = []
        recent = {q for q, _ in self._slowest}
        for r in [r for r in self.last if r not in recent]:  # (bounded by the window: never every rank)
            self.last.pop(r)
        for r in recent | set(self.since):
            ratios = [x for q, x in self._slowest if q == r]
            window = ratios + [1.0] * (len(self._slowest) - len(ratios))
            if len(window) < self.cfg.window:
                continue
            found, over = self._episode(
                step, r, _median(window),
                {"compute_s": round(slow.value, 6) if r == slow.rank else None, "mean_rank_s": round(mid, 6)},
                {"view": "slowest rank vs the mean"})
            out += [found] if found else []
            if over:
                self.last.pop(r, None)
        return out

    def persisting(self, step: int) -> list[int]:
        """Ranks slow for ``persist_steps`` or more (their hosts go to suspect_hosts.json)."""
        return [r for r, s in self.since.items() if step - s + 1 >= self.cfg.persist_steps]
