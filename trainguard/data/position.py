"""A resumable, sample-id-aware data position and the loader trainguard hands back.

When ``training_data`` is given, ``ds_plugins.initialize`` returns a :class:`TrackedLoader`
instead of DeepSpeed's loader. It shards like ``DistributedSampler`` (a permutation seeded by
``seed + epoch``, rank ``r`` takes every ``world``-th index), but it knows, for every batch it
hands out, the dataset indices in it (the *sample ids*) and the position (epoch, batch within the
epoch, samples consumed by all data-parallel ranks). It reports both to a listener (the guard) at
the BATCH point, and its position is a ``state_dict`` so a checkpoint can resume mid-epoch.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils.data import default_collate

from trainguard.config import DataConfig, SanitizeConfig
from trainguard.data.sanitize import active as sanitize_active
from trainguard.data.sanitize import sanitize


@dataclass(frozen=True)
class DataPosition:
    epoch: int
    batch_in_epoch: int       # batches already handed out in this epoch, on each rank
    consumed_samples: int     # over all data-parallel ranks, since the start of training

    def as_dict(self) -> dict:
        return asdict(self)


class ShardedSampler:
    """The indices one data-parallel rank reads in a given epoch. Deterministic on every rank."""

    def __init__(self, num_samples: int, rank: int, world: int, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = True):
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside a data-parallel world of {world}")
        self.num_samples, self.rank, self.world = num_samples, rank, world
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last

    def per_rank(self) -> int:
        if self.drop_last:
            return self.num_samples // self.world
        return -(-self.num_samples // self.world)

    def indices(self, epoch: int, offset: int = 0) -> list[int]:
        """Rank ``rank``'s share of the epoch's order, after the first ``offset`` positions (which
        were consumed, by every rank together, before a resume at another world size)."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            order = torch.randperm(self.num_samples, generator=g).tolist()
        else:
            order = list(range(self.num_samples))
        total = self.per_rank() * self.world
        if total > len(order):  # pad by wrapping around, as DistributedSampler does
            order += order[: total - len(order)]
        if offset:
            rest = order[offset:len(order) if not self.drop_last else self.num_samples]
            keep = len(rest) // self.world * self.world if self.drop_last else len(rest)
            return rest[:keep][self.rank::self.world]
        return order[self.rank:total:self.world]


class TrackedLoader:
    """Iterate it like a DataLoader: each ``for batch in loader`` runs to the end of the epoch.

    ``last_sample_ids`` and ``position`` describe the batch handed out last. ``listener`` (the
    guard's ``on_batch``) is called with ``(sample_ids, position, rejected)`` before each batch is
    returned; ``rejected`` lists ``(sample_id, problems)`` the sanitiser set aside on the way
    (dropped samples, or whole quarantined batches, which are skipped: the next batch is read).
    ``quarantine`` holds every sample id set aside so far. ``sample_hook(samples)`` (fault
    injection) may alter the raw samples before the sanitiser sees them.
    """

    def __init__(self, dataset: Sequence, batch_size: int, rank: int, world: int,
                 cfg: DataConfig | None = None, collate_fn: Callable | None = None,
                 listener: Callable[..., Any] | None = None, sanitize_cfg: SanitizeConfig | None = None,
                 sample_hook: Callable[[list], list] | None = None):
        cfg = cfg or DataConfig()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.world = world
        self.sampler = ShardedSampler(len(dataset), rank, world, cfg.shuffle, cfg.seed, cfg.drop_last)
        self.drop_last = cfg.drop_last
        self.collate_fn = collate_fn or default_collate
        self.listener = listener
        self.epoch = 0
        self.batch_in_epoch = 0
        self.consumed_samples = 0
        self.last_sample_ids: list[int] = []
        self.rank = rank
        self.sanitize_cfg = sanitize_cfg if sanitize_cfg is not None and sanitize_active(sanitize_cfg) else None
        self.sample_hook = sample_hook
        self.quarantine: list[int] = []   # in the order set aside (what state_dict persists)
        self._quarantined: set[int] = set()
        self.epoch_offset = 0  # order positions consumed in this epoch under another world size
        if len(self) == 0:
            raise ValueError(f"the dataset ({len(dataset)} samples) does not fill one micro-batch of "
                             f"{batch_size} on each of {world} data-parallel ranks")

    def __len__(self) -> int:
        per_rank = len(self.sampler.indices(self.epoch, self.epoch_offset)) if self.epoch_offset \
            else self.sampler.per_rank()
        return self._batches(per_rank)

    def _batches(self, samples: int) -> int:
        return samples // self.batch_size if self.drop_last else -(-samples // self.batch_size)

    def set_aside(self, ids) -> None:
        """Quarantine sample ids: never read again, and persisted with the position."""
        for i in ids:
            if i not in self._quarantined:
                self._quarantined.add(i)
                self.quarantine.append(i)

    @property
    def position(self) -> DataPosition:
        return DataPosition(self.epoch, self.batch_in_epoch, self.consumed_samples)

    def __iter__(self) -> Iterator:
        epoch0 = self.epoch
        order = self.sampler.indices(self.epoch, self.epoch_offset)
        n_batches = self._batches(len(order))  # epoch and offset stay fixed for this pass
        rejected: list = []
        # a rollback may move the position (even into a later epoch) while this loop runs
        while self.epoch == epoch0 and self.batch_in_epoch < n_batches:
            start = self.batch_in_epoch * self.batch_size
            ids = order[start:start + self.batch_size]
            self.batch_in_epoch += 1
            self.consumed_samples += len(ids) * self.world
            if self._quarantined:  # quarantined samples are never read again
                ids = [i for i in ids if i not in self._quarantined]
                if not ids:
                    continue
            samples = [self.dataset[i] for i in ids]
            if self.sample_hook is not None:
                samples = self.sample_hook(samples)
            if self.sanitize_cfg is not None:
                ids, samples, bad = sanitize(ids, samples, self.sanitize_cfg, self.rank)
                rejected += bad
                self.set_aside(i for i, _ in bad)
                if not samples:  # quarantined, or every sample dropped: read the next batch
                    continue
            batch = self.collate_fn(samples)
            self.last_sample_ids = ids
            if self.listener is not None:
                self.listener(ids, self.position, rejected)
            rejected = []
            yield batch
        if self.epoch == epoch0:
            self.epoch += 1
            self.batch_in_epoch = 0
            self.epoch_offset = 0

    def skip(self, batches: int) -> None:
        """Move the position forward by ``batches`` (across epoch ends), reading nothing."""
        while batches > 0:
            take = min(batches, len(self) - self.batch_in_epoch)
            self.batch_in_epoch += take
            self.consumed_samples += take * self.batch_size * self.world
            batches -= take
            if self.batch_in_epoch >= len(self):
                self.epoch += 1
                self.batch_in_epoch = 0
                self.epoch_offset = 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
                "consumed_samples": self.consumed_samples, "quarantine": list(self.quarantine),
                "epoch_offset": self.epoch_offset, "batch_size": self.batch_size, "world": self.world}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self.batch_in_epoch = int(state["batch_in_epoch"])
        self.consumed_samples = int(state["consumed_samples"])
        self.quarantine, self._quarantined = [], set()
        self.set_aside(int(i) for i in state.get("quarantine", []))
        self.epoch_offset = int(state.get("epoch_offset", 0))
        old_world = int(state.get("world", self.world))
        old_batch = int(state.get("batch_size", self.batch_size))
        if (old_world, old_batch) != (self.world, self.batch_size):
            # another data-parallel layout: the ranks together had consumed a prefix of this
            # epoch's order; carry on after it, split the new way (no sample lost or repeated)
            self.epoch_offset += self.batch_in_epoch * old_batch * old_world
            self.batch_in_epoch = 0


def merge_positions(states: list) -> Any:
    """The data position a resume at another layout goes on from, given every old rank's (rank order): rank 0's --
    a TrackedLoader's position is the epoch's common prefix, which the new ranks split their own way -- with every
    old rank's quarantine merged (a batch set aside on one rank stays set aside on all)."""
    if not states or states[0] is None:
        return None
    if not isinstance(states[0], dict):
        return states[0]
    data = dict(states[0])
    if any(isinstance(s, dict) and "quarantine" in s for s in states):
        data["quarantine"] = sorted({i for s in states if isinstance(s, dict) for i in s.get("quarantine", [])})
    return data
