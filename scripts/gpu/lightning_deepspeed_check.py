"""GPU check: PyTorch Lightning's DeepSpeedStrategy under trainguard's zero-code entry.

Not run by the test suite: Lightning's DeepSpeedStrategy refuses to run without CUDA, and the test
machines have none. Run it where a GPU is (install lightning *without* its ``deepspeed`` extra, which
pins deepspeed<0.17):

    pip install lightning
    trainguard run -- python scripts/gpu/lightning_deepspeed_check.py --out /tmp/tg-lightning

Lightning builds the engine with ``deepspeed.initialize`` from the config it is given, block
included; the zero-code entry routes that call through ``ds_plugins.initialize``. The script's
own code knows nothing of trainguard. A ``nan_loss`` fault (the block's ``faults``) poisons step 5
on rank 0. It prints what it saw: the engine class Lightning trained (``TrainguardDeepSpeedEngine``
when the entry is on), the records trainguard wrote, the steps DeepSpeed skipped. Exit 0 when the
engine was guarded and the NaN step was skipped on every rank, 1 otherwise. Sample ids are not
reported under Lightning (its loader is neither trainguard's nor one Accelerate prepared).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tg-lightning")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--devices", type=int, default=torch.cuda.device_count() or 1)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import lightning as L
    from lightning.pytorch.strategies import DeepSpeedStrategy

    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": 2}, "bf16": {"enabled": True},
              "trainguard": {"metrics": {"jsonl": str(out / "trainguard.jsonl")}, "allow_faults": True,
                             "faults": [{"type": "nan_loss", "step": 5, "rank": 0}]}}

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x).float(), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(1024, 32, generator=g), torch.randn(1024, 1, generator=g))
    trainer = L.Trainer(accelerator="gpu", devices=args.devices, strategy=DeepSpeedStrategy(config=config),
                        max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    model = Tiny()
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8))
    engine = trainer.strategy.model
    if trainer.global_rank != 0:
        return 0
    lines = [json.loads(x) for x in (out / "trainguard.jsonl").read_text().splitlines()] \
        if (out / "trainguard.jsonl").exists() else []
    events = [(x["step"], x["event"], x["ranks"], x["action"]) for x in lines if x["type"] == "event"]
    print(f"engine class: {type(engine).__name__}")
    print(f"deepspeed skipped steps: {engine.skipped_steps}, global steps: {engine.global_steps}")
    for e in events:
        print("record:", *e)
    guarded = type(engine).__name__.startswith("Trainguard")
    skipped = any(ev == "nonfinite" and step == 5 and action == "skip_step" for step, ev, _, action in events)
    print("OK" if guarded and skipped else "NOT GUARDED" if not guarded else "THE NaN STEP WAS NOT SKIPPED")
    return 0 if guarded and skipped else 1


if __name__ == "__main__":
    sys.exit(main())
