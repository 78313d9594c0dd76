"""One rank, no launcher: a real DeepSpeed engine guarded by ds_plugins.initialize, whose step ``--skip`` is refused
by a force_action fault. Prints one JSON line: per step, whether the decision was taken at the update's launch
(trainguard.step.launchgate), whether the weights and the inner optimizer's state changed, DeepSpeed's counters.
tests/dist/test_launch_gate_dist.py reads it."""
import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _single_rank import single_rank_env  # noqa: E402

import torch  # noqa: E402


def state_of(engine, stage: int) -> list[torch.Tensor]:
    """The weights (ZeRO-3's module holds only partitions gathered on demand: not those) and every tensor of the
    innermost torch optimizer's state (its master weights and moments)."""
    inner = engine.optimizer
    while not isinstance(inner, torch.optim.Optimizer) and hasattr(inner, "optimizer"):
        inner = inner.optimizer
    tensors = [p.detach().clone() for p in engine.module.parameters()] if stage < 3 else []
    tensors += [p.detach().clone() for g in inner.param_groups for p in g["params"]]
    for s in inner.state.values():
        tensors += [v.detach().clone() for v in s.values() if isinstance(v, torch.Tensor)]
    return tensors


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", type=int, default=0)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--skip", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    single_rank_env(29800 + 10 * args.stage)
    import ds_plugins
    from tests.support.gate_spy import watch_launches

    reached = watch_launches()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, "steps_per_print": 10 ** 9,
           "zero_optimization": {"stage": args.stage},
           "trainguard": {"metrics": {"jsonl": os.path.join(args.out, "trainguard.jsonl"), "console": False},
                          "allow_faults": True,
                          "faults": [{"type": "force_action", "step": args.skip, "action": "skip"}]}}
    if args.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine, _, _, scheduler = ds_plugins.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=cfg)
    g = torch.Generator().manual_seed(1)
    steps = []
    for step in range(1, args.steps + 1):
        x = torch.randn(4, 8, generator=g).to(next(engine.module.parameters()).dtype)
        before, lr_before = state_of(engine, args.stage), scheduler.get_last_lr()[0]
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        n = len(reached)
        engine.step()
        after = state_of(engine, args.stage)
        steps.append({"step": step, "at_launch": reached[n] if len(reached) > n else None,
                      "changed": any(not torch.equal(a, b) for a, b in zip(before, after)),
                      "lr_stepped": scheduler.get_last_lr()[0] != lr_before,
                      "skipped_steps": engine.skipped_steps, "global_steps": engine.global_steps,
                      "optimizer": type(engine.optimizer).__name__})
    engine.destroy()
    Path(args.out, "gate.json").write_text(json.dumps(steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
