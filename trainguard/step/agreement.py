"""AGREE: this rank's row in, every rank's agreed view of the step out, in a size that does not grow with the world.

Two ways, chosen once by the world size, the same on every rank:

- **table** (up to ``TABLE_UP_TO`` = 64 ranks): one all-reduce of every rank's row (trainguard.ranks.isolation), read on
  the host once -- at most ~10 KB. Every rank's row is there on every step: the metric line's per-rank lists,
  the straggler detector's medians, your detectors' ``observe(step, observations)``.
- **summary** (above): two fixed-size all-reduces (trainguard.ranks.reduced: 168 bytes per rank), read on the host
  once together with this rank's own row. The rows travel only on a step that needs them, and then as a
  tensor, turned into observations only for the ranks that matter: a step where a rank's value was
  non-finite, a fault fired or samples were set aside (the ranks concerned), a sampled check that compares
  every rank (the replica check, peer replay, a detector of yours without ``needs = "summary"``), or a verdict
  whose suspects need every rank's loss (:meth:`StepView.column`).

The detectors decide from :class:`trainguard.ranks.reduced.Summary` in both ways (of the table: the same formulas
as before it existed), so what a run decides does not depend on which way its world took.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from trainguard.ranks.glance import Glance
from trainguard.ranks.isolation import FIELDS, F, TorchCollective, observations
from trainguard.ranks.reduced import SUMS, Summary, as_floats, contribution, rank_bits
from trainguard.verdicts import RankObservation

TABLE_UP_TO = 64


def table_up_to() -> int:
    """The largest world that takes the table every step (``TRAINGUARD_TABLE_UP_TO`` overrides it: 0 makes a
    two-rank test run the summary way)."""
    raw = os.environ.get("TRAINGUARD_TABLE_UP_TO", "")
    return int(raw) if raw.strip().lstrip("-").isdigit() else TABLE_UP_TO


@dataclass
class StepView:
    """What AGREE hands DECIDE: the summary, this rank's own row, and the rows gathered this step (every rank's in
    the table way; in the summary way none on a healthy step). Iterating it yields the gathered rows in rank
    order."""

    summary: Summary
    own: RankObservation
    rows: dict[int, RankObservation]
    full: bool                                   # rows holds every rank
    table: torch.Tensor | None = None            # the gathered table, when one was
    fetch: Callable[[], torch.Tensor] | None = field(default=None, repr=False)

    def __iter__(self) -> Iterator[RankObservation]:
        return iter([self.rows[r] for r in sorted(self.rows)])

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, rank: int) -> RankObservation:
        return self.rows[rank]

    @property
    def glance(self):
        """What a clear step's check reads (trainguard.ranks.glance): the summary itself, or -- the table's lazy view
        -- the few figures made before anything else."""
        return self.summary

    def rows_table(self) -> torch.Tensor:
        """Every rank's row as a host tensor ``[world, columns]``; takes the table now if this step did not (a
        collective: call it on every rank alike)."""
        if self.table is None:
            self.table = self.fetch()
        return self.table.cpu()


class _TableView(StepView):
    """The table way's view, read at the update's launch: its glance made from the host rows when the clear check
    reads it, its observations, summary and rows when first asked for (after the launch, where DECIDE runs)."""

    def __init__(self, host: list, rank: int, table: torch.Tensor, obs: Callable[[list], list],
                 loss_scale: float, grad_divisor: float):
        self.full, self.table, self.fetch = True, table, None
        made: dict = {}  # (summary, own, rows: shared with the glance's fallback, which holds no reference to the
        # view -- a step's view is freed with its last reference, not by the cycle collector)

        def make() -> dict:
            if not made:
                every = obs(host)
                made.update(summary=Summary.of_rows(every), own=every[rank], rows=dict(enumerate(every)))
            return made

        self._make = make
        self._scale = (host, loss_scale, grad_divisor)
        self._glance: Glance | None = None

    @property
    def glance(self) -> Glance:  # (made when the clear check first reads it: a step decided before its launch never)
        if self._glance is None:
            make = self._make
            self._glance = Glance(*self._scale, lambda: make()["summary"])
        return self._glance

    def __getattr__(self, name: str):  # (summary, own and rows: made once, together, when first read)
        if name not in ("summary", "own", "rows"):
            raise AttributeError(name)
        self.__dict__.update(self._make())
        return self.__dict__[name]


class Agreement:
    """One per rank: builds the AGREE row's host part and runs the step's collectives (``collective``: the
    three methods of :class:`trainguard.ranks.isolation.TorchCollective`, over ``group``)."""

    def __init__(self, rank: int, world: int, device: torch.device, group=None, collective=None,
                 extra: Sequence[str] = (), up_to: int | None = None):
        self.rank, self.world, self.device = rank, world, device
        self.collective = collective if collective is not None else TorchCollective(group)
        self.extra = tuple(extra)
        self.summary_way = world > (table_up_to() if up_to is None else up_to)
        self.bits = rank_bits(world)
        self._rank_t = torch.tensor([rank], dtype=torch.int64, device=device)
        self._pinned: torch.Tensor | None = None

    @property
    def way(self) -> str:
        return "summary" if self.summary_way else "table"

    @property
    def bytes_per_step(self) -> int:
        """What a healthy step all-reduces, per rank."""
        from trainguard.ranks.reduced import BYTES

        return BYTES if self.summary_way else 8 * self.world * (len(FIELDS) + len(self.extra))

    def row(self, host: list) -> torch.Tensor:
        """The host-known fields as this step's row on the collective's device. On a GPU through a pinned buffer,
        copied without blocking: a copy from pageable memory would wait for the whole backward (a second host
        sync per step, measured on an H200). The buffer is rewritten only after the previous step's values were
        read on the host, by which time its copy has run."""
        if self.device.type != "cuda":
            return torch.tensor(host, dtype=torch.float64, device=self.device)
        if self._pinned is None or self._pinned.numel() != len(host):
            self._pinned = torch.empty(len(host), dtype=torch.float64, pin_memory=True)
        self._pinned.copy_(torch.tensor(host, dtype=torch.float64))
        return self._pinned.to(self.device, non_blocking=True)

    def agree(self, row: torch.Tensor, loss_scale: float = 1.0, grad_divisor: float = 1.0,
              want_rows: bool = False) -> StepView:
        """The step's collectives and its one host read. ``want_rows``: every rank's row is needed this step (the
        same on every rank)."""
        return self.launch(row, loss_scale, grad_divisor, want_rows)()

    def launch(self, row: torch.Tensor, loss_scale: float = 1.0, grad_divisor: float = 1.0,
               want_rows: bool = False) -> Callable[[], StepView]:
        """The step's collectives, launched; the returned call reads them on the host (and takes whatever else the
        step needs). Between the two, what the framework queues keeps a GPU busy while the host waits for the
        read: on a GPU the result is copied to pinned host memory without blocking, behind an event that the
        read waits on -- the wait covers the backward and this collective, never the work queued after them."""
        def obs(rows, ranks=None):
            return observations(rows, loss_scale=loss_scale, grad_divisor=grad_divisor, extra=self.extra,
                                ranks=ranks)

        if not self.summary_way:
            table = self.collective.table(row)
            ready = _to_host(table)

            def read_table() -> StepView:  # (ready().tolist(): the single host synchronisation of a healthy step)
                return _TableView(ready().tolist(), self.rank, table, obs, loss_scale, grad_divisor)
            return read_table
        sums, keys = contribution(row.reshape(1, -1), self._rank_t, loss_scale, grad_divisor, self.bits)
        sums, keys = self.collective.reduce(sums[0], keys[0])
        ready = _to_host(torch.cat([sums.view(torch.int64), keys, row.reshape(-1).view(torch.int64)]))

        def read_summary() -> StepView:
            read = ready().tolist()  # (one sync)
            n = len(SUMS)
            m = n + keys.numel()
            summary = Summary.reduced(as_floats(read[:n]), read[n:m], self.bits)
            own = obs([as_floats(read[m:])], [self.rank])[0]

            def fetch() -> torch.Tensor:
                return self.collective.table(row)

            if not (want_rows or summary.needs_rows):
                return StepView(summary, own, {}, False, None, fetch)
            table = fetch()
            if want_rows:
                return StepView(summary, own, dict(enumerate(obs(table.tolist()))), True, table, fetch)
            # the ranks that matter: non-finite, a fault fired, samples set aside (a vectorised pick, then their rows)
            t = table.cpu()
            every = torch.arange(t.shape[0])
            sums_each, _ = contribution(t, every, loss_scale, grad_divisor, self.bits)
            pick = (sums_each[:, SUMS.index("bad")] > 0) | (t[:, F["faults_fired"]] > 0) | \
                (t[:, F["samples_rejected"]] > 0)
            ranks = every[pick].tolist()
            return StepView(summary, own, dict(zip(ranks, obs(t[pick].tolist(), ranks))), False, table, fetch)
        return read_summary

    def objects(self, obj: Any, ranks: Sequence[int] | None = None) -> dict[int, Any]:
        """``{rank: obj}`` from every rank (the table way, or ``ranks`` None) or only from ``ranks`` (the summary
        way: what a rank sends does not grow with the world)."""
        if not self.summary_way:
            ranks = None
        return self.collective.objects(obj, ranks)


def _to_host(t: torch.Tensor) -> Callable[[], torch.Tensor]:
    """``t``'s values on the host, when asked: on a GPU a copy into pinned memory queued now, without blocking, and an
    event after it (the call waits for that event alone); elsewhere ``t`` itself."""
    if t.device.type != "cuda":
        return lambda: t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()

    def ready() -> torch.Tensor:
        done.synchronize()
        return host
    return ready
