"""Sample ids through a loader somebody else built (trainguard/data/sample_tags.py): they travel inside the
batch, so worker processes and prefetching cannot mix them up; the sanitiser runs in the collate."""
import pytest
import torch

from trainguard.data.sample_tags import REJECTED, TAG, EmptyBatch, tag_loader, take_tags
from trainguard.config import parse_block


class Numbers(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return {"input_ids": torch.full((4,), i), "labels": torch.full((4,), i)}


def test_ids_match_the_samples_with_workers_and_prefetching():
    loader = torch.utils.data.DataLoader(Numbers(), batch_size=4, shuffle=True, num_workers=2, prefetch_factor=3,
                                         generator=torch.Generator().manual_seed(3))
    assert tag_loader(loader)
    seen = []
    for batch in loader:
        (_, kwargs, ids, rejected) = take_tags((), dict(batch))
        assert TAG not in kwargs and rejected == []
        assert ids == kwargs["input_ids"][:, 0].tolist()  # each id is the sample it came with
        seen += ids
    assert sorted(seen) == list(range(64)) and seen != list(range(64))  # shuffled, each once


def test_the_sanitiser_runs_in_the_collate_and_says_what_it_dropped():
    cfg = parse_block({"sanitize": {"vocab_size": 10}}).sanitize
    loader = torch.utils.data.DataLoader(Numbers(), batch_size=8, shuffle=False)
    tag_loader(loader, cfg)
    batch = next(iter(loader))
    inputs, kwargs, ids, rejected = take_tags((batch,), {})
    assert ids == [1, 2, 3, 4, 5, 6, 7] and rejected == [(0, ["all-zero sequence"])]  # (reject_all_zero)
    assert inputs[0]["input_ids"].shape[0] == 7
    batches = iter(loader)
    next(batches)
    second = next(batches)  # samples 8..15: ids >= 10 are outside the vocabulary
    _, kwargs, ids, rejected = take_tags((), dict(second))
    assert ids == [8, 9] and [r[0] for r in rejected] == [10, 11, 12, 13, 14, 15]
    assert kwargs["input_ids"].shape[0] == 2 and REJECTED not in kwargs
    with pytest.raises(EmptyBatch, match="rejected every sample of a batch.*sample 16: token id 16 outside"):
        next(batches)  # samples 16..23: nothing left to train on -- said clearly, not an IndexError


def test_a_tuple_batch_travels_wrapped_and_comes_out_unwrapped_with_its_ids_handed_to_the_next_forward():
    """Issue 27: a (features, labels) batch has no room for the ids; it is wrapped through the loader (workers
    included) and untag() -- patched into Accelerate's prepared loaders' __iter__ -- hands the loop its own
    tuple back, the ids waiting for the next forward (take_tags); a forward takes them once."""
    from trainguard.data.sample_tags import HANDOFF, WRAPPED, untag

    x = torch.arange(32, dtype=torch.float32).reshape(16, 2)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.arange(16)), batch_size=4,
                                         shuffle=True, num_workers=2, generator=torch.Generator().manual_seed(5))
    assert tag_loader(loader)
    HANDOFF.take()
    for raw in loader:
        assert type(raw) is dict and WRAPPED in raw
        features, labels = untag(raw)  # what the loop receives: its own tuple
        inputs, kwargs, ids, _ = take_tags((features,), {})
        assert ids == labels.tolist() and inputs[0] is features
        assert take_tags((features,), {})[2] is None  # taken once: a second forward names nothing stale
    plain = {"input_ids": torch.zeros(2)}
    assert untag(plain) is plain  # batches trainguard did not wrap pass untouched


def test_a_dict_batch_names_its_samples_when_the_loop_passes_the_model_its_fields_one_by_one():
    """``model(input_ids=batch["input_ids"], labels=batch["labels"])`` -- a common style of an Accelerate loop -- never
    hands the ids' key to the forward: every sample id was lost (a new user's trial). The prepared loader leaves a
    copy for the next forward; ``model(**batch)`` takes the key as before and the copy goes with it (nothing
    stale for a later forward)."""
    from trainguard.data.sample_tags import HANDOFF, untag

    loader = torch.utils.data.DataLoader([{"input_ids": torch.full((3,), i)} for i in range(12)], batch_size=4,
                                         shuffle=True, generator=torch.Generator().manual_seed(5))
    assert tag_loader(loader)
    HANDOFF.take()
    for n, raw in enumerate(loader):
        batch = untag(raw)
        assert batch is raw and TAG in batch  # (the loop's own dict, its key kept for model(**batch))
        if n % 2:
            _, kwargs, ids, _ = take_tags((), {"input_ids": batch["input_ids"]})  # its fields, one by one
        else:
            _, kwargs, ids, _ = take_tags((), dict(batch))
            assert TAG not in kwargs
        assert ids == batch["input_ids"][:, 0].tolist()
        assert take_tags((), {"input_ids": batch["input_ids"]})[2] is None  # taken once
    first, second = [untag(raw) for raw in loader][:2]  # a loop that fetches the next batch before the forward
    assert take_tags((), {"input_ids": first["input_ids"]})[2] is None  # (the ids left are the next batch's: none)
    untag(second)
    assert take_tags((), {"input_ids": second["input_ids"].clone()})[2] is None  # (a copy of its own: not known)


def test_a_loader_that_cannot_be_tagged_is_named_for_the_start_record():
    """Issue 27: an IterableDataset (no indices) or a loader without automatic batching used to leave the
    records' sample_ids empty later, silently; run_start now lists it (ds_plugins.facts, untagged_loaders)."""
    from trainguard.data.sample_tags import UNTAGGED

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(8))

    UNTAGGED.clear()
    assert not tag_loader(torch.utils.data.DataLoader(Stream(), batch_size=2))
    assert not tag_loader(torch.utils.data.DataLoader(Numbers(), batch_size=None))
    assert [u["loader"] for u in UNTAGGED] == ["DataLoader over Stream", "DataLoader over Numbers"]
    assert "IterableDataset" in UNTAGGED[0]["why"] and "batch_size=None" in UNTAGGED[1]["why"]
    UNTAGGED.clear()
