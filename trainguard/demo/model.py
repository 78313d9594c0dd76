"""A small GPT-style model in plain PyTorch (explicit softmax attention, so later detectors can
read the attention probabilities). About 0.35 M parameters at the demo's size."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.n_heads, self.d_head = n_heads, d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.softmax = nn.Softmax(dim=-1)  # a module, so hooks can read the attention probabilities
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, self.d_head).permute(2, 0, 3, 1, 4)
        logits = (q @ k.transpose(-1, -2)) / math.sqrt(self.d_head)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        probs = self.softmax(logits.masked_fill(~mask, float("-inf")))
        return self.drop(self.proj((self.drop(probs) @ v).transpose(1, 2).reshape(b, t, d)))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = Attention(d_model, n_heads, dropout)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model),
                                 nn.Dropout(dropout))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab_size: int = 128, seq_len: int = 32, d_model: int = 96, n_layers: int = 3,
                 n_heads: int = 4, dropout: float = 0.0, final_norm: bool = True):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Parameter(torch.zeros(seq_len, d_model))
        self.blocks = nn.ModuleList(Block(d_model, n_heads, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model) if final_norm else nn.Identity()  # (off: output logits free to grow)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, batch: dict) -> torch.Tensor:
        """Returns the mean next-token cross-entropy of the batch."""
        ids, labels = batch["input_ids"], batch["labels"]
        x = self.tok(ids) + self.pos[: ids.shape[1]].to(self.tok.weight.dtype)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))
