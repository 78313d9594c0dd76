"""One rank of a Hugging Face ``Trainer`` run over DeepSpeed (test support), launched as a user
would: ``[trainguard run --] torchrun --nproc_per_node 2 -m tests.support.hf_worker --config
ds_config.json --steps N --out DIR``. The script knows nothing of trainguard: the block in the
ds_config (and the prefix) is all.

A tiny GPT-2 built from a config in code (no downloads) learns a fixed random mapping from float
input embeddings to tokens; ``--nan-sample I`` puts a NaN into sample I's embeddings -- a dirty
sample in the data, nothing injected. Each rank writes ``DIR/result.rank<r>.json``: the logged
losses, the final global step, a checksum of the full parameters, whether they are finite.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from tests.support.results import finish

SEQ, EMB, VOCAB, SAMPLES = 16, 32, 64, 256


class Embeddings(torch.utils.data.Dataset):
    def __init__(self, nan_sample: int | None = None, seed: int = 7):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(SAMPLES, SEQ, EMB, generator=g)
        proj = torch.randn(EMB, VOCAB, generator=g)
        self.y = (self.x @ proj).argmax(-1)
        if nan_sample is not None:
            self.x[nan_sample, SEQ // 2, 3] = float("nan")

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return {"inputs_embeds": self.x[i], "labels": self.y[i]}


def _data_seed(seed: int) -> dict:
    """``data_seed`` where transformers can pass it on (it refuses it below Accelerate 1.1, which the support matrix
    leaves out anyway: seeded by ``seed`` there)."""
    from importlib.metadata import version

    major, minor = (int(x) for x in version("accelerate").split(".")[:2])
    return {"data_seed": seed} if (major, minor) >= (1, 1) else {}


def main(argv=None, make_trainer=None) -> int:
    """``make_trainer(model, targs, dataset, callbacks)``: the trainer to run (default: HF's ``Trainer``;
    tests/support/hf_shapes.py passes TRL's ``SFTTrainer``)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", required=True)
    ap.add_argument("--nan-sample", type=int)
    ap.add_argument("--save-steps", type=int, default=0)
    ap.add_argument("--resume", action="store_true", help="resume_from_checkpoint=True when output_dir has one")
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--local_rank", type=int, help="(the deepspeed launcher passes it)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_utils import get_last_checkpoint

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=EMB, vocab_size=VOCAB, n_positions=SEQ,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    targs = TrainingArguments(
        output_dir=str(out / "hf"), per_device_train_batch_size=4, max_steps=args.steps, learning_rate=3e-3,
        logging_steps=1, save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        deepspeed=args.config, use_cpu=True, bf16=args.bf16, report_to=[], seed=1, **_data_seed(1),
        dataloader_num_workers=0, disable_tqdm=True, warmup_steps=2)

    losses, lrs = [], []

    class Record(TrainerCallback):
        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append((state.global_step, logs["loss"]))
            if logs and "learning_rate" in logs:  # (what the Trainer's log says: its scheduler's get_last_lr())
                lrs.append((state.global_step, logs["learning_rate"]))

    if make_trainer is None:
        def make_trainer(model, targs, dataset, callbacks):
            return Trainer(model=model, args=targs, train_dataset=dataset, callbacks=callbacks)
    with targs.main_process_first(desc="dataset"):  # (as HF's example scripts build theirs: a barrier each side)
        dataset = Embeddings(args.nan_sample)
    trainer = make_trainer(model, targs, dataset, [Record()])
    resume = bool(args.resume and os.path.isdir(targs.output_dir) and get_last_checkpoint(targs.output_dir))
    trainer.train(resume_from_checkpoint=resume or None)
    # (whether trainguard closed its run when train() returned: the Trainer never destroys its engine)
    session = getattr(getattr(trainer.model_wrapped, "_trainguard", None), "session", None)
    closed = getattr(session, "closed", None)
    # (the run's length as trainguard read it off the Trainer's schedule: what a restart may throw away)
    length = getattr(getattr(session, "lr_history", None), "last_step", None)
    return finish(out, trainer.model, trainer.model_wrapped, losses=losses, lrs=lrs, global_step=trainer.state.global_step,
                  restart=os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"), guard_closed_after_train=closed,
                  run_length=length)

if __name__ == "__main__":
    sys.exit(main())
