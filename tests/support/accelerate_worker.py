"""One rank of a plain Accelerate training loop over DeepSpeed (test support), launched as a user
would: ``[trainguard run --] accelerate launch --config_file acc.yaml -m tests.support.accelerate_worker
--steps N --out DIR``; the DeepSpeed config (with or without the block) comes from the
accelerate config. The script knows nothing of trainguard. Each rank writes
``DIR/result.rank<r>.json`` (named by RANK: Accelerate on CPU may report process_index 0
everywhere, shared/docs/PLATFORM.md)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from tests.support.hf_worker import EMB, SEQ, VOCAB, Embeddings
from tests.support.results import finish


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", required=True)
    ap.add_argument("--nan-sample", type=int)
    ap.add_argument("--config", help="(unused: the DeepSpeed config comes from the accelerate config)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from transformers import GPT2Config, GPT2LMHeadModel

    accelerator = Accelerator()
    set_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=EMB, vocab_size=VOCAB, n_positions=SEQ,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = torch.utils.data.DataLoader(Embeddings(args.nan_sample), batch_size=4, shuffle=True,
                                         generator=torch.Generator().manual_seed(1))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses, step = [], 0
    while step < args.steps:
        for batch in loader:
            loss = model(**batch).loss
            accelerator.backward(loss)   # DeepSpeed: engine.backward + engine.step
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            losses.append(float(loss))
            if step >= args.steps:
                break
    return finish(out, accelerator.unwrap_model(model), model, losses=losses)

if __name__ == "__main__":
    sys.exit(main())
