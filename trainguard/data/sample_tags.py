"""Sample ids for loaders a framework builds (Hugging Face's Trainer, Accelerate, any torch DataLoader an
adapter is handed).

trainguard's own loader (``ds_plugins.initialize(training_data=...)``) knows every batch's dataset
indices. A loader somebody else built does not say, and a batch travels a long way from its
sampler to the model: worker processes, prefetching (torch's and Accelerate's one batch ahead),
device transfer. So the ids travel *inside* the batch: the loader's dataset is wrapped to hand
out ``(index, sample)`` pairs, its collate function to unwrap them, run the sanitiser (it drops
rejected samples, or fails, as configured) and add the indices under :data:`TAG`; the adapter's
forward takes them out of the batch before the model sees it (:func:`take_tags`; DeepSpeed:
ds_plugins/engine.py). Order, workers and prefetching cannot mix them up.

A batch that is not a mapping -- ``(features, labels)`` from a ``TensorDataset``, a bare tensor --
has no room for a key: the collate function then wraps it, ``{WRAPPED: batch, TAG: ids}``, which
travels through workers and Accelerate's device transfer like any dict, and Accelerate's prepared
loaders unwrap it as they hand it out (:func:`untag`, patched into their ``__iter__`` by the
adapter: ds_plugins/auto.py): the loop gets its own batch back, and the ids wait in :data:`HANDOFF` for the
next forward -- which is this batch's, since a loop trains on the batch it was just given.

What does not carry over to such a loader (the framework owns it): trainguard's shuffling and
data position (``data.*``), moving past bad batches on a rollback (``recovery.skip_batches``) and
the quarantine of sample ids in later epochs -- refused or documented (trainguard/support/support.py).
"""
from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any, Callable

TAG = "trainguard_sample_ids"
REJECTED = "trainguard_rejected"
WRAPPED = "trainguard_batch"  # a batch with no room for TAG (a tuple, a tensor), wrapped on its way


class _Handoff:
    """The ids of the batch a prepared loader last handed out unwrapped, until the next forward takes them."""

    def __init__(self):
        self.ids: list | None = None
        self.rejected: list = []
        self.values: tuple = ()  # (a mapping's values: its ids go only to a forward given one of them)

    def put(self, ids, rejected, values: tuple = ()) -> None:
        self.ids, self.rejected, self.values = list(ids), list(rejected), values

    def take(self, given: tuple = ()) -> tuple[list | None, list]:
        """The ids left, once (none where they belong to a mapping none of whose values the forward was ``given``:
        a loop that fetched the next batch before this forward -- its ids are not this forward's)."""
        ids, rejected, values = self.ids, self.rejected, self.values
        self.ids, self.rejected, self.values = None, [], ()
        if values and not any(g is v for g in given for v in values):
            return None, []
        return ids, rejected


HANDOFF = _Handoff()
UNTAGGED: list[dict] = []  # loaders Accelerate prepared that could not be tagged, and why (the run_start record)


def untag(batch):
    """What a prepared loader hands out: a wrapped batch unwrapped, its ids left in :data:`HANDOFF`. A mapping keeps
    its ids and leaves a copy there too: a loop that calls ``model(input_ids=batch["input_ids"], ...)`` never hands
    the key to the forward (a new user's Accelerate loop lost every sample id so)."""
    if type(batch) is dict and WRAPPED in batch:
        HANDOFF.put(_as_list(batch.get(TAG, [])), batch.get(REJECTED, []))
        return batch[WRAPPED]
    if isinstance(batch, MutableMapping) and TAG in batch:
        HANDOFF.put(_as_list(batch[TAG]), batch.get(REJECTED, []),
                    tuple(v for k, v in batch.items() if k not in (TAG, REJECTED)))
    return batch


def _as_list(ids) -> list:
    return ids.tolist() if hasattr(ids, "tolist") else list(ids)


class EmptyBatch(Exception):
    """Every sample of a batch from a framework's loader was rejected by the sanitiser. ``refill``: the adapter's
    advice on a loader that refills batches (its capabilities' ``HINTS``)."""

    def __init__(self, rejected, refill: str | None = None):
        self.rejected = rejected
        lines = "; ".join(f"sample {i}: {', '.join(p)}" for i, p in rejected[:8])
        super().__init__(f"trainguard.sanitize rejected every sample of a batch ({lines}): the loader is the "
                         "framework's, so trainguard cannot fetch others in their place; clean the dataset"
                         + (f", or {refill}" if refill else ""))


class _Tagged:
    __slots__ = ("index", "item")

    def __init__(self, index, item):
        self.index, self.item = index, item


class TaggedDataset:
    """A map-style dataset whose items come with their index (picklable: workers get a copy)."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        return _Tagged(int(index), self.dataset[index])

    def __getitems__(self, indices):
        many = getattr(self.dataset, "__getitems__", None)
        items = many(indices) if many is not None else [self.dataset[i] for i in indices]
        return [_Tagged(int(i), x) for i, x in zip(indices, items)]

    def __getattr__(self, name):  # (what the framework asks of the dataset: features, column names, ...)
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)


class TaggingCollate:
    def __init__(self, collate_fn: Callable, sanitize_cfg=None, refill: str | None = None):
        self.collate_fn = collate_fn
        self.sanitize_cfg = sanitize_cfg
        self.refill = refill

    def __call__(self, items: list) -> Any:
        if not items or not isinstance(items[0], _Tagged):
            return self.collate_fn(items)
        ids, samples = [t.index for t in items], [t.item for t in items]
        rejected: list = []
        cfg = self.sanitize_cfg
        if cfg is not None:
            from trainguard.data.sanitize import active as sanitizing
            from trainguard.data.sanitize import sanitize

            if sanitizing(cfg):
                ids, samples, rejected = sanitize(ids, samples, cfg)
                if not samples:  # a framework's loader cannot fetch replacements: nothing left to train on
                    raise EmptyBatch(rejected, self.refill)
        batch = self.collate_fn(samples)
        if not isinstance(batch, MutableMapping):
            batch = {WRAPPED: batch}  # (no room for a key: wrapped; the prepared loader unwraps it, untag)
        batch[TAG] = ids
        if rejected:
            batch[REJECTED] = rejected
        return batch


def tag_loader(loader, sanitize_cfg=None, refill: str | None = None) -> bool:
    """Tag a torch DataLoader in place (before Accelerate rebuilds it from its dataset and collate
    function). Returns whether it could: iterable datasets and loaders without automatic batching
    carry no indices. ``refill``: :class:`EmptyBatch`'s advice."""
    import torch.utils.data as tud

    if not isinstance(loader, tud.DataLoader) or getattr(loader, "_trainguard_tagged", False):
        return False
    why = None
    if isinstance(loader.dataset, tud.IterableDataset):
        why = "an IterableDataset has no indices to name its samples by"
    elif loader.batch_size is None and loader.batch_sampler is None:
        why = "a loader without automatic batching (batch_size=None) hands out samples its dataset batched"
    if why is not None:
        UNTAGGED.append({"loader": f"DataLoader over {type(loader.dataset).__name__}", "why": why,
                         "effect": "records of its batches carry no sample ids"})
        return False
    # DataLoader refuses to change its dataset after __init__; the iterators read it afresh
    object.__setattr__(loader, "dataset", TaggedDataset(loader.dataset))
    loader.collate_fn = TaggingCollate(loader.collate_fn, sanitize_cfg, refill)
    object.__setattr__(loader, "_trainguard_tagged", True)
    return True


def take_tags(inputs: tuple, kwargs: dict) -> tuple[tuple, dict, list | None, list]:
    """Take the tags out of a forward call's batch: ``model(**batch)`` or ``model(batch)``."""
    ids, rejected = None, []
    if TAG in kwargs:
        kwargs = dict(kwargs)
        ids = kwargs.pop(TAG)
        rejected = kwargs.pop(REJECTED, [])
    elif inputs and isinstance(inputs[0], MutableMapping) and TAG in inputs[0]:
        batch = inputs[0].copy() if hasattr(inputs[0], "copy") else dict(inputs[0])
        ids = batch.pop(TAG)
        rejected = batch.pop(REJECTED, [])
        inputs = (batch, *inputs[1:])
    left = HANDOFF.take((*inputs, *kwargs.values()))  # (the batch's ids, left by the loader that handed it out)
    if ids is None:
        ids, rejected = left
    if ids is not None and hasattr(ids, "tolist"):
        ids = ids.tolist()
    return inputs, kwargs, (list(ids) if ids is not None else None), list(rejected)
