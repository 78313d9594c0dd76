"""One rank of a tiny megatron-core GPT under torchrun, for the Megatron tests (test support only).

    torchrun --standalone --nproc_per_node 2 -m tests.support.megatron_worker --tp 2 --steps 20 --out DIR
        [--pp 2] [--config trainguard.json] [--no-guard]

megatron-core's own parts: ``parallel_state`` groups, ``GPTModel`` (local layer spec), its
``DistributedDataParallel``, ``get_megatron_optimizer`` and ``get_forward_backward_func``; the
CPU compatibility layer of tests/support/megatron_cpu.py. Each rank writes
``DIR/result.rank<r>.json``: losses (last pipeline stage), steps applied/skipped, a checksum of its
parameters, whether they are finite.
"""
from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import torch
import torch.distributed as dist

from tests.support import megatron_cpu

SEQ, VOCAB, MICRO = 32, 128, 4


def batches(seed: int, dp_rank: int, dp_world: int, consumed: int = 0, split: str = "train"):
    """Token sequences from the demo corpus, split across data-parallel ranks; sample ids with them.
    ``consumed``: micro-batches every rank has read already (a resume)."""
    from trainguard.demo.corpus import MarkovCorpus

    corpus = MarkovCorpus(seed=seed, seq_len=SEQ, split=split)
    i = dp_rank * MICRO + consumed * MICRO * dp_world
    while True:
        ids = [(i + k) % len(corpus) for k in range(MICRO)]
        samples = [corpus[j] for j in ids]
        yield {"tokens": torch.stack([s["input_ids"] for s in samples]),
               "labels": torch.stack([s["labels"] for s in samples]), "sample_ids": ids}
        i += MICRO * dp_world


def _digest(model, opt) -> str:
    """The weights and every tensor of the inner torch optimizer(s)' state, hashed."""
    d = hashlib.sha256()
    tensors = [p.detach() for p in model.parameters()]
    for o in getattr(opt, "chained_optimizers", None) or [opt]:
        inner = getattr(o, "optimizer", o)
        tensors += [p.detach() for g in inner.param_groups for p in g["params"]]
        tensors += [v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        d.update(t.float().cpu().numpy().tobytes())
    return d.hexdigest()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", help="a JSON file with the trainguard block")
    ap.add_argument("--no-guard", action="store_true")
    ap.add_argument("--digest-each", action="store_true", help="after every iteration, a digest of the weights and the "
                    "inner torch optimizer's state (its master weights and moments): result['digests']")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dropout", type=float, default=0.0, help="hidden and attention dropout (draws from megatron's "
                    "tensor-parallel RNG tracker: what an exact resume must restore)")
    ap.add_argument("--fp16", action="store_true", help="fp16 with megatron's Float16Module and DynamicGradScaler")
    ap.add_argument("--bf16", action="store_true", help="bf16 with megatron's Float16Module (no loss scale)")
    ap.add_argument("--dist-opt", action="store_true", help="megatron's distributed optimizer")
    ap.add_argument("--ckpt", help="snapshot directory (megatron_hooks.checkpoint)")
    ap.add_argument("--save-at", type=int, action="append", default=[], help="save after this iteration")
    ap.add_argument("--resume", action="store_true", help="load the newest valid snapshot from --ckpt first")
    ap.add_argument("--stop-after", type=int, help="leave the loop after this iteration (a job cut short)")
    ap.add_argument("--until-step", action="store_true", help="--steps counts the guard's iterations, not the loop's")
    ap.add_argument("--replay", action="store_true", help="data or weights: install(replayer=...) over this loop's "
                    "forward step, and guard.record(...) per micro-batch (the megatron-core user's API)")
    args = ap.parse_args(argv)
    import megatron_hooks

    megatron_cpu.enable()
    return megatron_hooks.supervised(lambda: run(args))()  # (under trainguard.supervise: entered again after a death)


def run(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not dist.is_initialized():  # (trainguard.supervise formed the world already)
        dist.init_process_group("gloo")
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig

    ps.initialize_model_parallel(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)
    cfg = TransformerConfig(num_layers=args.layers, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                            pipeline_dtype=torch.half if args.fp16 else torch.bfloat16 if args.bf16 else torch.float32, hidden_dropout=args.dropout, attention_dropout=args.dropout,
                            tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
                            fp16=args.fp16, bf16=args.bf16,
                            params_dtype=torch.half if args.fp16 else torch.bfloat16 if args.bf16 else torch.float32)
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                     max_sequence_length=SEQ, pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage())
    from megatron.core.distributed import finalize_model_grads

    cfg.finalize_model_grads_func = finalize_model_grads  # the data-parallel (and embedding) gradient reduction
    if args.fp16 or args.bf16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(cfg, model)
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(use_distributed_optimizer=args.dist_opt), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=3e-3, clip_grad=1.0, fp16=args.fp16, bf16=args.bf16,
                                                 use_distributed_optimizer=args.dist_opt, initial_loss_scale=1024.0, min_loss_scale=1.0, hysteresis=2,
                                                 loss_scale_window=1000), [ddp])

    MICROBATCHES = 2
    loop = {"consumed": 0}  # micro-batches read so far: the data position saved with every snapshot
    guard = None
    at_launch: list = []  # (--digest-each: whether each iteration reached trainguard.step.launchgate's launch)
    if args.digest_each:
        from tests.support.gate_spy import watch_launches

        at_launch = watch_launches()
    if args.config:
        import megatron_hooks

        block = json.loads(Path(args.config).read_text())
        block.setdefault("metrics", {})["jsonl"] = str(out / "trainguard.jsonl")
        # --no-guard with a config: plain megatron, with the config's faults injected
        replayer = None
        if args.replay:
            from megatron_hooks.replay import Replayer

            replayer = Replayer([ddp], lambda it, m: forward_step(it, m), SEQ, MICRO)
        guard = megatron_hooks.install([ddp], opt, block, guard_enabled=not args.no_guard,
                                       data_state=lambda: dict(loop), replayer=replayer, train_iters=args.steps)
        if guard.guard is None:
            guard, _faults_only = None, guard  # (kept: its fault hooks stay on the model)

    start, consumed = 0, 0
    state = guard.resumed_data_state if guard is not None else None  # checkpoint.dir: resumed at install
    if args.resume:
        state = guard.checkpointer.load(args.ckpt)
    if state is not None:
        start, consumed = guard.iteration, int(state["consumed"])
    loop["consumed"] = consumed
    data = batches(1234, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), consumed)
    position = torch.arange(SEQ).unsqueeze(0).expand(MICRO, SEQ)
    mask = torch.tril(torch.ones(SEQ, SEQ, dtype=torch.bool)).logical_not().unsqueeze(0).unsqueeze(0)

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        if model.training:
            loop["consumed"] += 1
        if guard is not None:
            guard.on_batch(b["sample_ids"])
        rows = b["tokens"].shape[0]  # (a replay of one row is a batch of one)
        output = model(b["tokens"], position[:rows], mask, labels=b["labels"])

        def loss_func(per_token):
            loss = per_token.float().mean()
            return loss, {"loss": loss.detach().clone()}
        return output, loss_func

    train_step_func = forward_step
    if args.replay and guard is not None:
        from megatron_hooks.replay import Recording

        def train_step_func(data_iterator, model):  # what each micro-batch drew, kept for a replay
            recording = Recording(data_iterator)
            out = forward_step(recording, model)
            guard.record(recording.drawn)
            return out

    fb = get_forward_backward_func()
    result = {"rank": dist.get_rank(), "losses": [], "applied": [], "coords": {
        "dp": ps.get_data_parallel_rank(), "tp": ps.get_tensor_model_parallel_rank(),
        "pp": ps.get_pipeline_model_parallel_rank()}}
    def probe() -> float | None:
        """Loss on a fixed batch, forward only: the same on every layout when the weights are."""
        fixed = iter([next(batches(99, 0, 1))] * 1)
        ddp.eval()
        with torch.no_grad():
            out = fb(forward_step_func=forward_step, data_iterator=fixed, model=[ddp], num_microbatches=1,
                     seq_length=SEQ, micro_batch_size=MICRO, forward_only=True)
        ddp.train()
        return float(out[0]["loss"]) if out else None

    result["first_iteration"] = start
    result["probe"] = {str(start): probe()}
    def iterations():
        it = start
        # --until-step: like DeepSpeed's loop, run until the guard's iteration (rollbacks set it back) reaches --steps
        while (guard.iteration if args.until_step else it) < args.steps:
            yield it
            it += 1

    for it in iterations():
        ddp.zero_grad_buffer()
        opt.zero_grad()
        losses = fb(forward_step_func=train_step_func, data_iterator=data, model=[ddp], num_microbatches=MICROBATCHES,
                    seq_length=SEQ, micro_batch_size=MICRO, forward_only=False)
        applied, _, _ = opt.step()
        if not applied and guard is None:  # (megatron alone: a skipped step leaves its gradients)
            opt.zero_grad()
        result["applied"].append(bool(applied))
        if args.digest_each:
            result.setdefault("digests", []).append(_digest(model, opt))
            result["at_launch"] = at_launch
        result.setdefault("loss_scale", []).append(float(opt.get_loss_scale()))
        if losses:
            result["losses"].append(float(sum(x["loss"] for x in losses) / len(losses)))
        if it + 1 in args.save_at:
            guard.checkpointer.save(args.ckpt, data_state={"consumed": (it + 1) * MICROBATCHES})
            result["probe"][str(it + 1)] = probe()
        if args.stop_after is not None and it + 1 == args.stop_after:
            break  # (a job that ends here: the next launch resumes)
    result["probe"]["end"] = probe()
    held = batches(1234, 0, 1, split="heldout")  # the training chain's held-out sequences
    ddp.eval()
    with torch.no_grad():
        held_out = fb(forward_step_func=forward_step, data_iterator=held, model=[ddp], num_microbatches=4,
                 seq_length=SEQ, micro_batch_size=MICRO, forward_only=True)
    ddp.train()
    result["eval_loss"] = float(sum(x["loss"] for x in held_out) / len(held_out)) if held_out else None
    result["param_dtype"] = str(next(ddp.parameters()).dtype).replace("torch.", "")
    params = [p.detach().float() for p in model.parameters()]
    digest = hashlib.sha256()
    for p in params:
        digest.update(p.numpy().tobytes())
    if guard is not None:
        result["guard_iteration"] = guard.iteration
        result["run_length"] = guard.session.lr_history.last_step  # (what bounds a restart: train_iters)
    result.update({"param_sha256": digest.hexdigest(), "param_count": sum(p.numel() for p in params),
                   "weights_finite": all(bool(torch.isfinite(p).all())
                                                                             for p in params)})
    (out / f"result.rank{dist.get_rank()}.json").write_text(json.dumps(result, indent=1))
    if guard is not None:
        guard.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from trainguard.demo.run import leave

    leave(main())
