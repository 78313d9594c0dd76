"""Checkpoint I/O against the filesystem's own speed, measured in the same run.

    python bench/checkpoint_io.py [--d-model 512] [--layers 6] [--repeat 3] [--dir DIR]

One rank, a ZeRO-2 bf16 engine with AdamW state (~270 MB at the default size). Printed, as
medians over ``--repeat`` runs:

- raw write: the same files' bytes written with plain open/write/fsync into the same directory;
- plain DeepSpeed: its own ``save_checkpoint`` (no commit protocol), plus ``os.sync()``;
- save (sync): ``engine.save_checkpoint`` under trainguard (DeepSpeed's write + sidecars + fsync +
  sha256 manifest + atomic rename) -> throughput and ratio to raw (goal >= 0.8);
- save (async): the time the training loop is blocked, over the sync save time (goal <= 0.1),
  and the background total;
- load: verify (sha256) + DeepSpeed load -> throughput.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _single_rank import single_rank_env  # noqa: E402

single_rank_env(30500)

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build(args, root: Path, async_save: bool):
    import ds_plugins
    from trainguard.demo.model import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(vocab_size=512, seq_len=64, d_model=args.d_model, n_layers=args.layers, n_heads=4)
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 9, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": 2}, "bf16": {"enabled": True},
           "trainguard": {"metrics": {"jsonl": str(root / "bench.jsonl")},
                          "checkpoint": {"async": async_save, "keep_last": 100, "verify_steps": 0}}}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, _, _, _ = ds_plugins.initialize(model=model, optimizer=opt, config=cfg)
    batch = {"input_ids": torch.randint(0, 512, (2, 64)), "labels": torch.randint(0, 512, (2, 64))}
    loss = engine(batch)
    engine.backward(loss)
    engine.step()  # the optimizer state exists now
    return engine


def raw_write(files: list[Path], dest: Path) -> float:
    dest.mkdir(parents=True)
    blobs = [(f.name, f.read_bytes()) for f in files]
    t0 = time.perf_counter()
    for name, data in blobs:
        with open(dest / name, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
    fd = os.open(dest, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", help="filesystem to measure (default: a temporary directory)")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)
    base = Path(args.dir or tempfile.mkdtemp(prefix="tg-ckpt-bench-"))
    base.mkdir(parents=True, exist_ok=True)
    from trainguard.checkpoint.manifest import Manifest

    sync_engine = build(args, base, async_save=False)
    save_t, raw_t, load_t, plain_t, nbytes = [], [], [], [], 0
    plain_save = type(sync_engine).__mro__[1].save_checkpoint  # DeepSpeed's own, no trainguard
    for i in range(args.repeat):
        t0 = time.perf_counter()
        plain_save(sync_engine, str(base / f"plain{i}"), tag=f"bench{i}")
        os.sync()  # DeepSpeed does not fsync; count the flush to be fair to the others
        plain_t.append(time.perf_counter() - t0)
        root = base / f"sync{i}"
        t0 = time.perf_counter()
        sync_engine.save_checkpoint(str(root), tag=f"bench{i}")
        save_t.append(time.perf_counter() - t0)
        man = Manifest.read(root / f"bench{i}")
        nbytes = man.total_bytes
        files = [root / f"bench{i}" / rel for rel in man.files]
        raw_t.append(raw_write(files, base / f"raw{i}"))
        t0 = time.perf_counter()
        sync_engine.load_checkpoint(str(root), tag=f"bench{i}")
        load_t.append(time.perf_counter() - t0)
    sync_engine._trainguard.close()

    async_engine = build(args, base / "a", async_save=True)
    block_t, total_t = [], []
    for i in range(args.repeat):
        root = base / f"async{i}"
        t0 = time.perf_counter()
        async_engine.save_checkpoint(str(root), tag=f"bench{i}")
        block_t.append(time.perf_counter() - t0)
        async_engine._trainguard.checkpointer.wait_pending()
        total_t.append(time.perf_counter() - t0)
    async_engine._trainguard.close()

    mb = nbytes / 1e6
    med = statistics.median
    fig = {"bytes": nbytes, "raw_write_MBps": mb / med(raw_t), "save_MBps": mb / med(save_t),
           "save_over_raw": med(raw_t) / med(save_t), "sync_save_s": med(save_t),
           "plain_deepspeed_MBps": mb / med(plain_t), "save_over_plain_deepspeed": med(plain_t) / med(save_t),
           "async_blocking_s": med(block_t), "async_total_s": med(total_t),
           "async_blocking_over_sync": med(block_t) / med(save_t), "load_MBps": mb / med(load_t),
           "load_s": med(load_t)}
    print(f"checkpoint I/O: {mb:.0f} MB of state (ZeRO-2 bf16, AdamW), {args.repeat} runs, medians, in {base}")
    print(f"  raw write (open/write/fsync)   {fig['raw_write_MBps']:8.0f} MB/s")
    print(f"  save, sync (trainguard)        {fig['save_MBps']:8.0f} MB/s   ratio to raw {fig['save_over_raw']:.2f}"
          f"  (goal >= 0.8)")
    print(f"  save, plain DeepSpeed (+sync)  {fig['plain_deepspeed_MBps']:8.0f} MB/s   trainguard / plain DeepSpeed "
          f"{fig['save_over_plain_deepspeed']:.2f}")
    print(f"  save, async: blocking {fig['async_blocking_s']:.3f} s, total {fig['async_total_s']:.3f} s; "
          f"blocking / sync save {fig['async_blocking_over_sync']:.3f}  (goal <= 0.1)")
    print(f"  load (verify + DeepSpeed load) {fig['load_MBps']:8.0f} MB/s")
    if args.json:
        Path(args.json).write_text(json.dumps(fig, indent=1))
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
