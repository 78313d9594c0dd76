"""One rank of the demo (and of the distributed tests): train TinyGPT under torchrun.

    torchrun --standalone --nproc_per_node 2 -m trainguard.demo.worker --config C --steps N --out DIR

``--plain`` trains with ``deepspeed.initialize`` itself (DeepSpeed's own loader and behaviour)
with only the configured faults attached, for the side-by-side comparison. Each rank writes
``DIR/result.rank<r>.json``: per-step local losses, skipped-step counters, whether its weights are
finite, a checksum of the full parameters, and the loss on a fixed held-out batch.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import time
from pathlib import Path

import torch

from trainguard import config as tg_config
from trainguard.demo.corpus import MarkovCorpus
from trainguard.demo.model import TinyGPT
from trainguard.errors import TrainguardAbort
from trainguard.observe.goodput import GoodputMeter


def build_config(path: str, out: Path, zero_stage: int | None, dtype: str | None, plain: bool) -> dict:
    cfg = tg_config.read_json(path)
    if zero_stage is not None:
        cfg.setdefault("zero_optimization", {})["stage"] = zero_stage
    if dtype is not None:
        for key in ("bf16", "fp16", "bfloat16"):
            cfg.pop(key, None)
        if dtype == "bf16":
            cfg["bf16"] = {"enabled": True}
        elif dtype == "fp16":
            # small initial scale: the default 2**16 wastes the first steps halving it
            cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 50}
    block = cfg.setdefault("trainguard", {})
    ck = block.get("checkpoint")
    if isinstance(ck, dict) and ck.get("every_steps") and not ck.get("dir"):
        ck["dir"] = str(out / "ckpt")  # the demo keeps its checkpoints beside its logs
    metrics = block.setdefault("metrics", {})
    metrics["jsonl"] = str(out / ("plain.jsonl" if plain else "trainguard.jsonl"))
    return cfg


def _full_params(engine):
    """Full (gathered) parameters as fp32 CPU tensors, in name order."""
    import deepspeed

    params = list(engine.module.named_parameters())
    if engine.zero_optimization_stage() == 3:
        with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
            return [(n, p.detach().float().cpu().clone()) for n, p in params]
    return [(n, p.detach().float().cpu().clone()) for n, p in params]


def _state_digest(engine) -> dict:
    """sha256 of the full fp32 master parameters and of Adam's two moments (every rank calls: ZeRO
    gathers them), to compare an optimizer state across a save and a load."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for key in ("fp32", "exp_avg", "exp_avg_sq"):
        digest = hashlib.sha256()
        for _, p in engine.module.named_parameters():
            t = safe_get_full_fp32_param(p) if key == "fp32" else safe_get_full_optimizer_state(p, key)
            digest.update(b"none" if t is None else t.detach().float().cpu().numpy().tobytes())
        out[key] = digest.hexdigest()
    return out


def _finite(result: dict) -> dict:
    return {**result, "losses": [x if x is not None and math.isfinite(x) else None for x in result["losses"]]}


def _plain_init_distributed(timeout_s: float) -> None:
    """What a careful plain-DeepSpeed user does: DeepSpeed's own timeout on the process group. In a
    restarted torchrun attempt the group goes on a store prefix of its own: the gloo workaround of
    shared/docs/PLATFORM.md, so that the baseline measures DeepSpeed's recovery, not this machine's
    gloo quirk (trainguard's runs get the same through ds_plugins)."""
    from datetime import timedelta

    import deepspeed
    import torch.distributed as dist

    td = timedelta(seconds=timeout_s)
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0 and not dist.is_initialized():
        from trainguard.bootstrap import attempt_store

        store, rank, world, td = attempt_store(td)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=td)
    deepspeed.init_distributed(dist_backend="gloo", timeout=td)


def _bad_data(batch: dict, step: int, spec: str, vocab: int) -> dict:
    """A stretch of corrupted data reaching the model (what the corpus bench feeds; not a trainguard fault)."""
    start, end, kind = spec.split(":")
    if not int(start) <= step < int(end):
        return batch
    g = torch.Generator().manual_seed(step)
    ids = batch["input_ids"]
    if kind == "random":
        seq = torch.randint(0, vocab, (ids.shape[0], ids.shape[1] + 1), generator=g)
    else:
        seq = torch.full((ids.shape[0], ids.shape[1] + 1), int(torch.randint(0, vocab, (1,), generator=g)))
    return {**batch, "input_ids": seq[:, :-1].to(ids.device), "labels": seq[:, 1:].to(ids.device)}


def _raise_lr(engine, spec: str) -> None:
    """From STEP on, the scheduler's peak (and its ramp) FACTOR times higher: a resumed run whose schedule was
    raised. Once."""
    step, factor = spec.split(":")
    sched = engine.lr_scheduler
    if engine.global_steps + 1 != int(step) or sched is None or getattr(sched, "_raised", False):
        return
    for name in ("max_lrs", "delta_lrs"):
        if hasattr(sched, name):
            setattr(sched, name, [x * float(factor) for x in getattr(sched, name)])
    sched._raised = True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", required=True)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", required=True)
    ap.add_argument("--plain", action="store_true", help="plain deepspeed.initialize, faults only")
    ap.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3])
    ap.add_argument("--dtype", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--step-sleep", type=float, default=0.0,
                    help="seconds to sleep after each step (stands in for a bigger model in liveness tests)")
    ap.add_argument("--d-model", type=int, default=96)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--dropout", type=float, default=0.0, help="dropout (draws from the RNG an exact resume restores)")
    ap.add_argument("--state-digest", action="store_true",
                    help="hash the fp32 master parameters and Adam moments at the start (after a resume) and the end")
    ap.add_argument("--plain-save-every", type=int, default=0,
                    help="--plain as a careful user runs it: engine.save_checkpoint every N steps, load_checkpoint of "
                         "the latest at start (the data moved past what was consumed)")
    ap.add_argument("--plain-timeout", type=float, default=0.0,
                    help="--plain: deepspeed.init_distributed(timeout=...) in seconds (DeepSpeed's own collective "
                         "timeout; 0: its default)")
    nat = ap.add_argument_group("natural failures (bench/natural: settings that really fail, nothing injected)")
    nat.add_argument("--adam-eps", type=float, default=1e-8)
    nat.add_argument("--adam-beta2", type=float, default=0.999)
    nat.add_argument("--heads", type=int, default=4)
    nat.add_argument("--no-final-norm", action="store_true", help="no LayerNorm before the output head")
    nat.add_argument("--bad-data", metavar="FROM:TO:KIND", help="optimizer steps [FROM, TO) read corrupted batches: "
                     "KIND random (a shard of another tokenizer: uniform ids), repeat (one token repeated)")
    nat.add_argument("--raise-lr", metavar="STEP:FACTOR", help="from STEP the scheduler's peak LR is FACTOR times "
                     "higher (a run resumed with a raised schedule)")
    ap.add_argument("--load", metavar="DIR:TAG", help="engine.load_checkpoint(DIR, tag=TAG) after initialize, as a "
                    "user's own call (tests: an explicit load goes through the same verification)")
    args = ap.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = build_config(args.config, out, args.zero_stage, args.dtype, args.plain)

    import deepspeed
    from deepspeed.accelerator import get_accelerator

    import ds_plugins
    from ds_plugins.engine import attach

    if cfg.get("fp16", {}).get("enabled"):
        # CPU test switch (shared/docs/PLATFORM.md): DeepSpeed refuses fp16 on CPU otherwise.
        get_accelerator().is_fp16_supported = lambda: True

    torch.manual_seed(args.seed)
    model = TinyGPT(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, dropout=args.dropout,
                    final_norm=not args.no_final_norm)
    dataset = MarkovCorpus(seed=args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, eps=args.adam_eps,
                                  betas=(0.9, args.adam_beta2))

    if args.plain:
        if args.plain_timeout:
            _plain_init_distributed(args.plain_timeout)
        engine, _, loader, _ = deepspeed.initialize(model=model, optimizer=optimizer, training_data=dataset,
                                                    config=cfg)
        block = tg_config.parse_block(cfg["trainguard"])
        if block.faults:
            attach(engine, block, guard_enabled=False)
        if args.plain_save_every:
            plain_dir = out / "plain_ckpt"
            if (plain_dir / "latest").exists():
                engine.load_checkpoint(str(plain_dir))
    else:
        engine, _, loader, _ = ds_plugins.initialize(model=model, optimizer=optimizer, training_data=dataset,
                                                     config=cfg)
    if args.load:
        load_dir, _, tag = args.load.rpartition(":")
        engine.load_checkpoint(load_dir, tag=tag)
    rank = torch.distributed.get_rank()
    result = {"rank": rank, "plain": args.plain, "losses": [], "aborted": None,
              "engine_class": type(engine).__name__, "first_step": engine.global_steps}
    if args.state_digest and engine.global_steps > 0:  # (a resumed engine; a fresh one has no Adam state yet)
        result["state_at_start"] = _state_digest(engine)
    micro = []
    meter = GoodputMeter()  # the plain run's goodput (a guarded run's own meter reports in run_end)
    epoch = 0
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    with open(out / f"starts.rank{rank}.txt", "a") as f:  # one line per (re)start: the drill's wall clock
        f.write(f"{attempt} {time.time():.3f}\n")
    # one line per optimizer step on rank 0 (attempt, step, time, applied): the drill's per-fault costs
    progress = open(out / "progress.rank0.txt", "a", buffering=1) if rank == 0 else None
    skip_micro = 0
    if args.plain and engine.global_steps:  # a careful user's resume: past the batches already consumed
        done = engine.global_steps * engine.gradient_accumulation_steps()
        epoch, skip_micro = divmod(done, len(loader))
    try:
        while engine.global_steps < args.steps:
            sampler = getattr(loader, "data_sampler", None)
            if hasattr(sampler, "set_epoch"):  # DeepSpeed's loader reshuffles only when told (as torch's does)
                sampler.set_epoch(epoch)
            epoch += 1
            for batch in loader:
                if skip_micro:
                    skip_micro -= 1
                    continue
                meter.begin_step()
                if args.raise_lr:
                    _raise_lr(engine, args.raise_lr)
                if args.bad_data:
                    batch = _bad_data(batch, engine.global_steps + 1, args.bad_data, dataset.vocab_size)
                loss = engine(batch)
                engine.backward(loss)
                micro.append(loss.detach().float().item())
                boundary = engine.is_gradient_accumulation_boundary()
                engine.step()
                if boundary:
                    result["losses"].append(sum(micro) / len(micro))
                    micro = []
                    meter.step_done(engine.global_steps, engine.was_step_applied())
                    if progress is not None:
                        progress.write(f"{attempt} {engine.global_steps} {time.time():.4f} "
                                       f"{int(engine.was_step_applied())}\n")
                    if args.plain and args.plain_save_every and engine.global_steps % args.plain_save_every == 0:
                        engine.save_checkpoint(str(out / "plain_ckpt"))
                    if args.step_sleep:
                        time.sleep(args.step_sleep)
                if engine.global_steps >= args.steps:
                    break
    except TrainguardAbort as e:
        result["aborted"] = {"message": str(e), "report": e.report}
    except Exception as e:  # plain DeepSpeed stopping (e.g. at the minimum loss scale): say where, then fail
        result.update({"died": f"{type(e).__name__}: {e}"[:400], "global_steps": engine.global_steps,
                       "goodput": meter.summary(), "t_end": time.time()})
        (out / f"result.rank{rank}.json").write_text(json.dumps(_finite(result), indent=1))
        raise
    result["goodput"] = meter.summary()
    result["t_end"] = time.time()

    if args.state_digest:
        result["state_at_end"] = _state_digest(engine)
    params = _full_params(engine)
    digest = hashlib.sha256()
    for _, p in params:
        digest.update(p.numpy().tobytes())
    held_out = MarkovCorpus(num_samples=64, seed=args.seed, split="heldout")
    batch = {k: torch.stack([held_out[i][k] for i in range(64)]) for k in ("input_ids", "labels")}
    engine.eval()
    with torch.no_grad():
        eval_loss = float(engine.module(batch))
    state = getattr(engine, "_trainguard", None)
    result.update({
        "global_steps": engine.global_steps,
        "skipped_steps": engine.skipped_steps,
        "guard_skipped_steps": state.guard.skipped_steps if state is not None and state.guard else None,
        "weights_finite": all(bool(torch.isfinite(p).all()) for _, p in params),
        "param_sha256": digest.hexdigest(),
        "eval_loss": eval_loss if math.isfinite(eval_loss) else None,
        "final_train_loss": next((x for x in reversed(result["losses"]) if math.isfinite(x)), None),
        "nonfinite_train_losses": sum(1 for x in result["losses"] if not math.isfinite(x)),
        "sample_ids_known": hasattr(loader, "last_sample_ids"),
    })
    (out / f"result.rank{rank}.json").write_text(json.dumps(_finite(result), indent=1))
    engine.destroy()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    from trainguard.demo.run import leave

    leave(main())
