"""One rank of the plain Accelerate script of issue 27, as a new user writes it from the docs (test
support): a dataset of feature/label tensors, a ``DataLoader(shuffle=True, drop_last=True)``, one
``accelerator.prepare(model, optimizer, loader)``, ``accelerator.backward`` and ``optimizer.step``.
The DeepSpeed config (ZeRO-2, with or without the block) reaches Accelerate in one of three ways:

- ``--ds-dict FILE``: read here and handed over as a dict, ``DeepSpeedPlugin(hf_ds_config=dict)``;
- ``--ds-file FILE``: its path, ``DeepSpeedPlugin(hf_ds_config=path)``;
- neither: ``Accelerator()`` alone, the config coming from ``accelerate launch``'s config file.

The script knows nothing of trainguard. Each rank writes ``DIR/result.rank<r>.json`` (named by RANK:
Accelerate on CPU may report process_index 0 everywhere, shared/docs/PLATFORM.md)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from tests.support.results import finish

FEATURES, CLASSES, SAMPLES = 16, 4, 64


def dataset(bad: int | None) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = torch.randint(0, CLASSES, (SAMPLES,), generator=g)
    if bad is not None:
        x[bad, 3] = float("inf")  # one sample holds +inf in its features
    return torch.utils.data.TensorDataset(x, y)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", required=True)
    ap.add_argument("--nan-sample", type=int)
    ap.add_argument("--ds-dict")
    ap.add_argument("--ds-file")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.utils import set_seed

    if args.ds_dict or args.ds_file:
        config = json.loads(Path(args.ds_dict).read_text()) if args.ds_dict else args.ds_file
        accelerator = Accelerator(mixed_precision="bf16", deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    else:
        accelerator = Accelerator()
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.Tanh(), torch.nn.Linear(32, CLASSES))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(dataset(args.nan_sample), batch_size=8, shuffle=True, drop_last=True,
                                         generator=torch.Generator().manual_seed(1))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    dtype = next(model.parameters()).dtype  # (DeepSpeed's bf16 engine holds bf16 weights; inputs follow)
    losses, seen, step = [], [], 0
    while step < args.steps:
        for features, labels in loader:
            loss = torch.nn.functional.cross_entropy(model(features.to(dtype)).float(), labels)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            losses.append(float(loss))
            seen.append(int(torch.isinf(features).any()))
            if step >= args.steps:
                break
    return finish(out, accelerator.unwrap_model(model), model, losses=losses,
                  bad_batch_at=[i + 1 for i, s in enumerate(seen) if s])

if __name__ == "__main__":
    sys.exit(main())
