"""This rank's replays at DECIDE: the micro-batches it recorded, data-or-weights, per-sample narrowing, and what a
peer replay (trainguard.detectors.peer_replay) is handed. The verdicts over replayed losses are pure
(trainguard.replay.replay); here is when they run and with what, the same way on every rank.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from trainguard.errors import ConfigError
from trainguard.decisions import DATA_OR_WEIGHTS, anomaly_class
from trainguard.replay.replay import MicroBatch, ReplayBook, loggable, narrow, weights_verdict
from trainguard.verdicts import PeerContext, Verdict


def check_replayable(recovery, replay: Callable | None, peer_replay: Callable | None, exchanging: bool,
                     hint: str | None = None) -> None:
    """A key the user set to true that needs a replay the adapter cannot make: refused by name (a key that silently
    does nothing would lie). ``exchanging``: the peer replay detector is on (trainguard.step.session checks it); ``hint``:
    the adapter's advice on giving it a replay (its capabilities' ``HINTS``)."""
    how = f" ({hint})" if hint else ""
    problems = [(f"trainguard.recovery.{k}", f"true needs a replay of your forward step, which this adapter was not "
                 f"given{how}; set false") for k in ("replay_check", "narrow_samples")
                if replay is None and k in recovery.model_fields_set and getattr(recovery, k)]
    if peer_replay is None and exchanging:
        problems.append(("trainguard.detectors.peer_replay.enabled",
                         f"true needs a replay of a micro-batch, which this adapter was not given{how}; set false"))
    if problems:
        raise ConfigError(problems)


class Replays:
    """``replay(micro_batch, row)`` (from an adapter that can; None: no data-or-weights check) -> the loss of one
    recorded micro-batch (``row`` None) or of one of its rows on the current weights; ``narrow_rows``: the culprit's
    rows may be replayed one by one; ``peers``: the ranks that replay together with this one (a model-parallel
    group); ``peer_replay``: ``(inputs, seed)`` -> ``(loss, output digest)`` for detectors.peer_replay; ``healthy``:
    the loss-spike detector's judgement of a loss; ``take_ids()``: the sample ids BATCH named since the last call (a
    recorded micro-batch's own); ``sampled(step)``: whether a sampled check that compares every rank runs then.

    The adapter hands it its training micro-batches (``session.replays``): :meth:`record` each one it can replay,
    when :attr:`wants_batches`; on a step where :meth:`peer_sampled`, the random-number state its training forward
    starts from and that forward's values (:meth:`measured`)."""

    def __init__(self, replay: Callable | None, peer_replay: Callable | None, narrow_rows: bool,
                 peers: set[int], healthy: Callable[[float], bool], acting: bool, *,
                 take_ids: Callable[[], list[int]], sampled: Callable[[int], bool]):
        self.replay, self.peer_replay, self.narrow_rows, self.peers = replay, peer_replay, narrow_rows, peers
        self.healthy, self.take_ids, self.sampled = healthy, take_ids, sampled
        self.acting = acting                 # recovery is on: a replay's verdict can change what is done
        self.book = ReplayBook()             # this step's micro-batches and the last healthy one
        self.check: dict | None = None       # the last anomaly step's weights check

    @property
    def wants_batches(self) -> bool:
        return self.replay is not None or self.peer_replay is not None

    def record(self, inputs: Any, rows: int | None) -> None:
        """A training micro-batch the adapter can replay (references: what a replay of it needs), after BATCH named
        its samples; ``rows``: its batch size, where known."""
        self.book.record(MicroBatch(inputs, self.take_ids(), rows))

    def peer_sampled(self, step: int) -> bool:
        """Whether a peer replays this step's last micro-batch (detectors.peer_replay)."""
        return self.peer_replay is not None and self.sampled(step)

    def measured(self, rng: Any, value: Any) -> None:
        """The last recorded micro-batch's RNG state before its training forward, and that forward's (loss, output
        digest) as device values (read at DECIDE of a sampled step only)."""
        if self.book.step:
            self.book.step[-1].rng, self.book.step[-1].value = rng, value

    @property
    def weights(self) -> str | None:
        """This step's weights check: "healthy" (the data was to blame), "damaged", or None (none made)."""
        return self.check["verdict"] if self.check else None

    def deciding(self, nonfinite: Verdict | None, spikes: list[Verdict]) -> list[Verdict]:
        """The verdicts a replay decides (trainguard.decisions.DATA_OR_WEIGHTS), when one can be made: the same on every
        rank (they come from the agreed step)."""
        if self.replay is None or not self.acting:
            return []
        return [v for v in ([nonfinite] if nonfinite else []) + spikes if anomaly_class(v) in DATA_OR_WEIGHTS]

    def run(self, deciding: list[Verdict]) -> tuple[float | None, dict | None]:
        """Every rank replays its last healthy micro-batch (together: a ZeRO-3 forward is collective); a culprit rank
        (with its replay peers) also replays its step's samples one by one."""
        self.check = None
        if not deciding:
            return None, None
        replayed = self.replay(self.book.healthy, None) if self.book.healthy is not None else None
        narrowed = None
        if self.narrow_rows and any(self.peers.intersection(v.ranks) for v in deciding) and self.book.step:
            narrowed = narrow(self.book.step, self.replay, self.healthy)
        return replayed, narrowed

    def judge(self, everyone: dict[int, dict]) -> None:
        """Every rank's replay of its healthy micro-batch (gathered) -> the step's weights check."""
        losses = [everyone[r]["replayed"] for r in sorted(everyone)]
        self.check = {"verdict": weights_verdict(losses, self.healthy), "replayed_losses": [loggable(x) for x in losses]}

    def peer_context(self, rank: int, coords: Sequence, device, group, deciding: list[Verdict],
                     everyone: dict[int, dict] | None, step_loss: dict[int, float]) -> PeerContext:
        """What detectors.peer_replay is handed at DECIDE. A spike neither the data nor the weights explain: the
        weights replay healthy and no sample is to blame (one micro-batch on the culprit: the one replayed is then
        the one that spiked)."""
        everyone = everyone or {}
        unexplained: Sequence[int] = ()
        if deciding and self.weights == "healthy" and not any((e or {}).get("narrowed") for e in everyone.values()):
            unexplained = sorted({r for v in deciding for r in v.ranks
                                  if everyone.get(r, {}).get("micro_batches") == 1})
        return PeerContext(rank=rank, coords=coords, device=device, group=group,
                           batch=self.book.step[-1] if self.book.step else None, replay=self.peer_replay,
                           healthy=self.healthy, unexplained=unexplained, step_loss=step_loss)
