"""One rank of a Hugging Face Trainer run of the demo's model, as a user writes it (the natural-failure corpus's
HF stack). It knows nothing of trainguard: under ``trainguard run -- torchrun ...`` the block in its ds_config is
all (the zero-code entry); without the prefix it is plain HF + DeepSpeed.

    torchrun --nproc_per_node 2 -m bench.natural.hf_train --config ds_config.json --steps N --out DIR
        [--lr 0.003] [--warmup 100] [--adam-eps E] [--adam-beta2 B] [--bad-data FROM:TO:KIND] [--no-final-norm]
        [--seed S] [--d-model D] [--layers L] [--heads H]

Writes ``DIR/result.rank<r>.json``: the per-step losses, the held-out loss, the step reached, and how it stopped.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch


class LM(torch.nn.Module):
    """The demo's TinyGPT, in the shape the Trainer calls: ``model(input_ids=..., labels=...) -> {"loss"}``."""

    def __init__(self, **kw):
        super().__init__()
        from trainguard.demo.model import TinyGPT

        self.gpt = TinyGPT(**kw)

    def forward(self, input_ids, labels):
        return {"loss": self.gpt({"input_ids": input_ids, "labels": labels})}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", required=True)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--adam-eps", type=float, default=1e-8)
    ap.add_argument("--adam-beta2", type=float, default=0.999)
    ap.add_argument("--bad-data")
    ap.add_argument("--no-final-norm", action="store_true")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--d-model", type=int, default=96)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--plain", action="store_true", help="(accepted for the bench's launcher; plain is no prefix)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from transformers import Trainer, TrainerCallback, TrainingArguments

    from trainguard.demo.corpus import MarkovCorpus
    from trainguard.demo.worker import _bad_data

    torch.manual_seed(args.seed)
    model = LM(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, final_norm=not args.no_final_norm)
    dataset = MarkovCorpus(seed=args.seed)
    targs = TrainingArguments(
        output_dir=str(out / "hf"), per_device_train_batch_size=8, max_steps=args.steps, learning_rate=args.lr,
        warmup_steps=args.warmup, lr_scheduler_type="constant_with_warmup", weight_decay=0.01,
        adam_epsilon=args.adam_eps, adam_beta2=args.adam_beta2, max_grad_norm=1.0, logging_steps=1,
        save_strategy="no", deepspeed=args.config, use_cpu=True, bf16=True, report_to=[], seed=args.seed,
        dataloader_num_workers=0, disable_tqdm=True)
    losses: list[float] = []
    now = {"step": 0}

    class Watch(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            now["step"] = state.global_step + 1

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    def collate(samples):
        batch = {k: torch.stack([s[k] for s in samples]) for k in ("input_ids", "labels")}
        # (the loader fetches a batch before on_step_begin: the step it is for is the next one)
        return _bad_data(batch, now["step"] + 1, args.bad_data, dataset.vocab_size) if args.bad_data else batch

    trainer = Trainer(model=model, args=targs, train_dataset=dataset, data_collator=collate, callbacks=[Watch()])
    rank = int(os.environ.get("RANK", "0"))
    result = {"rank": rank, "losses": losses, "died": None, "aborted": None}
    try:
        trainer.train()
    except Exception as e:  # a run that stops: say where (trainguard's abort is one, with its report)
        key = "aborted" if type(e).__name__ == "TrainguardAbort" else "died"
        result[key] = {"message": str(e)[:400]} if key == "aborted" else f"{type(e).__name__}: {e}"[:400]
    result["global_steps"] = trainer.state.global_step
    held = MarkovCorpus(num_samples=64, seed=args.seed, split="heldout")
    batch = {k: torch.stack([held[i][k] for i in range(64)]) for k in ("input_ids", "labels")}
    with torch.no_grad():
        value = float(model.gpt(batch).float())
    result["eval_loss"] = value if math.isfinite(value) and not result["died"] else None
    (out / f"result.rank{rank}.json").write_text(json.dumps(result, indent=1))
    from trainguard.demo.run import leave

    if result["died"] or result["aborted"]:
        leave(1)  # (no collective after a failure: a peer may be gone)
    torch.distributed.destroy_process_group()
    leave(0)


if __name__ == "__main__":
    sys.exit(main())
