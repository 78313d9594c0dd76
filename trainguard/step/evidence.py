"""DECIDE's first half: what the step shows, gathered the same way on every rank before the policy reads it.

The detectors' two rounds (trainguard.detectors.lineup) around the step's one object gather: ``early`` reads what
the agreement brought; when it found something, or a probe or check is sampled, or the sanitiser set samples aside,
every rank takes the gather -- carrying the first non-finite module (the adapter's ``localize``), the sampled probes'
values (trainguard.replay.probes), the replays' losses (trainguard.replay.replays: data or weights) and each rank's samples and
data position -- from every rank where every rank's values count, else from the ranks named; ``observe`` then reads
it. The decision itself is the policy's (trainguard.recovery.policy), taken by the guard.
"""
from __future__ import annotations

from typing import Callable

from trainguard.detectors.registry import Decide


class Evidence:
    """One per rank, over the guard's detectors, probes, replays and agreement. ``localize`` (from the adapter)
    replays this rank's last micro-batch with hooks and returns :func:`trainguard.replay.probes.first_nonfinite`'s report;
    every rank calls it on a non-finite step."""

    def __init__(self, cfg, rank: int, device, group, detectors, probes, replays, agreement,
                 localize: Callable[[], dict] | None):
        self.cfg, self.rank, self.device, self.group = cfg, rank, device, group
        self.detectors, self.probes, self.replays, self.agreement = detectors, probes, replays, agreement
        self.localize = localize
        # (a ladder of yours that skips what is found after the launch -- a creep, the loss trend's burst --: every
        # step decided before its update, as a skip after it cannot be taken)
        self.late_skips = any("skip_step" in cfg.recovery.ladders.get(c, ()) for c in ("slow_rise", "instant_burst"))

    def clear(self, step: int, view) -> bool:
        """Whether the step may be applied before it is decided, its DECIDE taken after the update's launch
        (trainguard.step.launchgate): nothing it gathers is due -- nothing non-finite, no fault fired, no sample set
        aside, no probe or check sampled, no row wanted -- and no detector could refuse it (a burst)."""
        s = view.glance  # (the summary's figures the check reads, made before the rest: trainguard.ranks.glance)
        return not (self.late_skips or s.needs_rows or self.probes.sampled(step) or self.detectors.wants_rows(step)) \
            and self.detectors.clear(step, s)

    def gather(self, step: int, ctx: Decide, tally, suspect: Callable[[int, int, str], None]) -> dict | None:
        """Fill ``ctx`` (its verdicts, the gathered objects, the weights check, the probes' values); returns every
        named rank's objects (``{rank: values}``), or None on a step that gathered none."""
        obs, s = ctx.view, ctx.view.summary
        self.detectors.early(step, ctx)  # before the gather: what the agreement shows
        nonfinite, spikes = ctx.nonfinite, list(ctx.found)
        localized = None
        if nonfinite is not None and nonfinite.anomaly == "nonfinite" and self.cfg.detectors.localize.enabled \
                and self.localize is not None:
            localized = self.localize()  # every rank replays together (ZeRO-3 / TP forwards are collective)
        sampled = self.probes.sampled(step)
        activation, entropy = self.probes.collect(sampled)
        deciding = self.replays.deciding(nonfinite, spikes)
        replayed, narrowed = self.replays.run(deciding)
        everyone = None
        if nonfinite or spikes or sampled or s.samples_rejected:
            # one object gather, taken by every rank: all of these conditions are the same everywhere. From every
            # rank where every rank's values count (a probe, the weights check), else from the ranks named
            named = None if sampled or deciding else sorted(
                {r for v in ([nonfinite] if nonfinite else []) + spikes for r in v.ranks}
                | {o.rank for o in obs if o.samples_rejected})
            everyone = self.agreement.objects({"sample_ids": tally.sample_ids, "rejected": tally.rejected,
                                               "position": tally.where(), "localized": localized,
                                               "activation": activation, "entropy": entropy, "replayed": replayed,
                                               "narrowed": narrowed, "micro_batches": tally.micro}, named)
        if everyone and deciding:
            self.replays.judge(everyone)
        ctx.everyone, ctx.weights = everyone, self.replays.weights
        ctx.probed = {"activation": activation, "entropy": entropy}
        self.detectors.observe(step, ctx, lambda: self.replays.peer_context(  # after it (objects, weights, probes)
            self.rank, ctx.coords, self.device, self.group, deciding, everyone,
            {o.rank: o.loss for o in obs} if obs.full else {s.loss_rank: s.loss_max.value}), self.group, suspect)
        return everyone
