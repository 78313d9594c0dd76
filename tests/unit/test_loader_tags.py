"""Sample ids through a loader somebody else built (ds_plugins/loaders.py): they travel inside the
batch, so worker processes and prefetching cannot mix them up; the sanitiser runs in the collate."""
import pytest
import torch

from ds_plugins.loaders import REJECTED, TAG, EmptyBatch, tag_loader, take_tags
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
