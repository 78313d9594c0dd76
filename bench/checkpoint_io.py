"""Checkpoint I/O against the filesystem's own speed, measured in the same run.

    python bench/checkpoint_io.py [--d-model 512] [--layers 6] [--repeat 3] [--dir DIR]

One rank, a ZeRO-2 bf16 engine with AdamW state (~270 MB at the default size). One unmeasured
round first (warm-up: the first save allocates and compiles), then ``--repeat`` rounds in which the
three writers take turns in a rotating order (none always goes first on a cold disk); medians:

- raw write: the same files' bytes written with plain open/write/fsync into the same directory;
- plain DeepSpeed: its own ``save_checkpoint`` (no commit protocol), plus ``os.sync()``;
- save (sync): ``engine.save_checkpoint`` under trainguard (DeepSpeed's write + sidecars + fsync +
  sha256 manifest + atomic rename) -> throughput and ratio to raw (goal >= 0.8);
- load, cold: the checkpoint's files dropped from the page cache first (``posix_fadvise
  DONTNEED`` after their fsync), then verify (sha256) + DeepSpeed load; and warm, read again;
- async under training: the loop trains; at a step it calls ``save_checkpoint`` (async) and goes on
  training while the background thread writes. Printed: the blocking time (over the sync save
  time: goal <= 0.1), the background write time, and what the write costs the training that runs
  meanwhile (step time during the write over step time without one) -- training time lost per save
  = blocking + the slowdown's extra seconds.
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


def drop_cache(root: Path) -> None:
    """Evict ``root``'s files from the page cache (written and fsynced: their pages are clean)."""
    for f in root.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def train_step(engine, batch) -> float:
    t0 = time.perf_counter()
    loss = engine(batch)
    engine.backward(loss)
    engine.step()
    return time.perf_counter() - t0


def async_under_training(engine, batch, root: Path, rounds: int, baseline_steps: int = 10) -> dict:
    """Train; save (async) at a step; keep training until the background write is done."""
    cp = engine._trainguard.checkpointer
    for _ in range(3):
        train_step(engine, batch)  # warm
    base = [train_step(engine, batch) for _ in range(baseline_steps)]
    block_t, write_t, during, extra = [], [], [], []
    for i in range(rounds):
        t0 = time.perf_counter()
        engine.save_checkpoint(str(root / f"async{i}"), tag=f"bench{i}")
        block_t.append(time.perf_counter() - t0)
        steps = []
        while cp.pending_tag() is not None:
            steps.append(train_step(engine, batch))
            cp.poll_pending()
        write_t.append(time.perf_counter() - t0 - block_t[-1])
        if steps:
            during.append(statistics.median(steps))
            extra.append(sum(steps) - len(steps) * statistics.median(base))
        base += [train_step(engine, batch) for _ in range(3)]  # (interleaved: the baseline drifts with the machine)
    med = statistics.median
    return {"step_s": med(base), "blocking_s": med(block_t), "background_s": med(write_t),
            "step_during_write_s": med(during) if during else None,
            "slowdown_during_write": med(during) / med(base) if during else None,
            "lost_per_save_s": med(block_t) + (med(extra) if extra else 0.0)}


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
    plain_save = type(sync_engine).__mro__[1].save_checkpoint  # DeepSpeed's own, no trainguard
    times: dict[str, list[float]] = {"plain": [], "save": [], "raw": [], "cold": [], "warm": []}
    nbytes = 0

    def plain(i):
        t0 = time.perf_counter()
        plain_save(sync_engine, str(base / f"plain{i}"), tag=f"bench{i}")
        os.sync()  # DeepSpeed does not fsync; count the flush to be fair to the others
        return time.perf_counter() - t0

    def save(i):
        t0 = time.perf_counter()
        sync_engine.save_checkpoint(str(base / f"sync{i}"), tag=f"bench{i}")
        return time.perf_counter() - t0

    def raw(i):
        j = i if (base / f"sync{i}").exists() else i - 1  # (when it goes first: the previous round's bytes)
        root = base / f"sync{j}" / f"bench{j}"
        man = Manifest.read(root)
        return raw_write([root / rel for rel in man.files], base / f"raw{i}")

    writers = [("plain", plain), ("save", save), ("raw", raw)]
    for i in range(-1, args.repeat):  # round -1: warm-up, not counted
        order = writers[i % 3:] + writers[:i % 3] if i >= 0 else writers
        for name, fn in order:
            t = fn(i)
            if i >= 0:
                times[name].append(t)
        if i < 0:
            continue
        root = base / f"sync{i}"
        nbytes = Manifest.read(root / f"bench{i}").total_bytes
        drop_cache(root)
        t0 = time.perf_counter()
        sync_engine.load_checkpoint(str(root), tag=f"bench{i}")
        times["cold"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        sync_engine.load_checkpoint(str(root), tag=f"bench{i}")
        times["warm"].append(time.perf_counter() - t0)
    sync_engine._trainguard.close()

    async_engine = build(args, base / "a", async_save=True)
    batch = {"input_ids": torch.randint(0, 512, (2, 64)), "labels": torch.randint(0, 512, (2, 64))}
    under = async_under_training(async_engine, batch, base / "a", args.repeat)
    async_engine._trainguard.close()

    mb = nbytes / 1e6
    med = {k: statistics.median(v) for k, v in times.items()}
    fig = {"bytes": nbytes, "raw_write_MBps": mb / med["raw"], "save_MBps": mb / med["save"],
           "save_over_raw": med["raw"] / med["save"], "sync_save_s": med["save"],
           "plain_deepspeed_MBps": mb / med["plain"], "save_over_plain_deepspeed": med["plain"] / med["save"],
           "load_cold_MBps": mb / med["cold"], "load_cold_s": med["cold"], "load_warm_MBps": mb / med["warm"],
           **{f"async_{k}": v for k, v in under.items()},
           "async_blocking_over_sync": under["blocking_s"] / med["save"]}
    print(f"checkpoint I/O: {mb:.0f} MB of state (ZeRO-2 bf16, AdamW), 1 warm-up + {args.repeat} interleaved "
          f"rounds, medians, in {base}")
    print(f"  raw write (open/write/fsync)   {fig['raw_write_MBps']:8.0f} MB/s")
    print(f"  save, sync (trainguard)        {fig['save_MBps']:8.0f} MB/s   ratio to raw {fig['save_over_raw']:.2f}"
          f"  (goal >= 0.8)")
    print(f"  save, plain DeepSpeed (+sync)  {fig['plain_deepspeed_MBps']:8.0f} MB/s   trainguard / plain DeepSpeed "
          f"{fig['save_over_plain_deepspeed']:.2f}")
    print(f"  load, cold (page cache dropped; verify + DeepSpeed load) {fig['load_cold_MBps']:8.0f} MB/s;"
          f" warm {fig['load_warm_MBps']:.0f} MB/s")
    slow = under["slowdown_during_write"]
    print(f"  save, async while training: blocking {under['blocking_s']:.3f} s = {fig['async_blocking_over_sync']:.3f}"
          f" of a sync save (goal <= 0.1); written in the background in {under['background_s']:.2f} s, during which"
          f" a step took {'-' if slow is None else f'{slow:.2f}x'} its time without a write"
          f" ({under['step_s'] * 1e3:.0f} ms); training time lost per save {under['lost_per_save_s']:.3f} s")
    goals = {"sync save >= 0.8 x raw write": fig["save_over_raw"] >= 0.8,
             "async blocking <= 0.1 x a sync save": fig["async_blocking_over_sync"] <= 0.1}
    for name, ok in goals.items():
        print(f"  goal: {name}: {'met' if ok else 'NOT met'}")
    if args.json:  # (kept with its date, commit and whether the tree was clean: bench/_results.keep)
        from bench._results import keep

        keep(args.json, {**fig, "goals": goals, "missed": [n for n, ok in goals.items() if not ok]})
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)
    torch.distributed.destroy_process_group()
    return 0 if all(goals.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
