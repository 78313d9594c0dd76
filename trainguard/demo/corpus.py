"""A deterministic corpus the package generates: sequences from a fixed sparse Markov chain.

Learnable (the loss falls from ln(vocab) towards the chain's entropy, ~1.4 nats), identical on
every machine for the same seed, and nothing to download.
"""
from __future__ import annotations

import torch
from torch.utils.data import Dataset


class MarkovCorpus(Dataset):
    def __init__(self, num_samples: int = 4096, seq_len: int = 32, vocab_size: int = 128, seed: int = 1234,
                 branching: int = 4, split: str = "train"):
        # the chain depends on the seed only; the split picks which sequences are drawn from it
        g = torch.Generator().manual_seed(seed)
        # each token may be followed by `branching` tokens, with skewed probabilities
        nxt = torch.randint(0, vocab_size, (vocab_size, branching), generator=g)
        probs = torch.softmax(torch.randn(vocab_size, branching, generator=g) * 1.5, dim=-1)
        g = torch.Generator().manual_seed(seed * 1000 + {"train": 0, "heldout": 1}[split])
        seqs = torch.empty(num_samples, seq_len + 1, dtype=torch.long)
        seqs[:, 0] = torch.randint(0, vocab_size, (num_samples,), generator=g)
        for t in range(seq_len):
            choice = torch.multinomial(probs[seqs[:, t]], 1, generator=g).squeeze(1)
            seqs[:, t + 1] = nxt[seqs[:, t], choice]
        self.seqs = seqs
        self.vocab_size, self.seq_len = vocab_size, seq_len

    def __len__(self) -> int:
        return self.seqs.shape[0]

    def __getitem__(self, i: int) -> dict:
        s = self.seqs[i]
        return {"input_ids": s[:-1], "labels": s[1:]}
