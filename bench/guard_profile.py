"""Where the guard's time and host synchronisations go, step by step (one rank; meant for a GPU).

Builds the guarded engine of ``bench/guard_overhead.py`` (same arguments), warms it up, then:

- records, for every synchronising CUDA call the runtime reports (``set_sync_debug_mode("warn")``) or,
  on a CPU, every host-synchronising tensor call, the innermost frame of trainguard/ds_plugins code on the
  stack (or of the framework's, when none of ours is on it): the sync's call site, counted per step;
- runs cProfile over the measured steps and prints trainguard's and ds_plugins' functions by cumulative
  host time per step (a function that waits on the GPU carries the wait).

    python bench/guard_profile.py [--steps 10] [guard_overhead's model arguments]
"""
from __future__ import annotations

import collections
import cProfile
import pstats
import sys
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _single_rank import single_rank_env  # noqa: E402

single_rank_env(29600)

import torch  # noqa: E402

import guard_overhead  # noqa: E402

OURS = ("trainguard/", "ds_plugins/", "megatron_hooks/")


def call_site() -> str:
    """The innermost frame of ours, and the innermost frame overall (where they differ)."""
    frames = [fr for fr in traceback.extract_stack()[:-2]
              if "bench/" not in fr.filename and "warnings" not in fr.filename]
    if not frames:
        return "(bench)"

    def short(fr):
        return f"{'/'.join(fr.filename.split('site-packages/')[-1].split('/')[-2:])}:{fr.lineno} {fr.name}"

    ours = next((fr for fr in reversed(frames) if any(o in fr.filename for o in OURS)), None)
    inner = frames[-1]
    if ours is None:
        return f"(framework) {short(inner)}"
    return short(ours) if ours is inner else f"{short(ours)}  <-  {short(inner)}"


def main() -> int:
    argv = sys.argv[1:]
    steps = 10
    if "--steps" in argv:
        i = argv.index("--steps")
        steps = int(argv[i + 1])
        del argv[i:i + 2]
    ap_args = guard_overhead_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    engines = {"plain": guard_overhead.build(ap_args, False, device),
               "guarded": guard_overhead.build(ap_args, True, device)}
    g = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(0, ap_args.vocab, (ap_args.batch, ap_args.seq), generator=g).to(device),
             "labels": torch.randint(0, ap_args.vocab, (ap_args.batch, ap_args.seq), generator=g).to(device)}
    sites: dict[str, collections.Counter] = {"plain": collections.Counter(), "guarded": collections.Counter()}
    active = [None]
    if cuda:
        shown = warnings.showwarning

        def on_warning(message, category, *a, **k):
            if "synchroniz" in str(message).lower():
                if active[0]:
                    sites[active[0]][call_site()] += 1
                return
            shown(message, category, *a, **k)

        warnings.showwarning = on_warning
        warnings.simplefilter("always")
    else:
        for name in guard_overhead.SYNC_METHODS:
            orig = getattr(torch.Tensor, name)

            def wrapper(t, *a, _orig=orig, **k):
                if active[0]:
                    sites[active[0]][call_site()] += 1
                return _orig(t, *a, **k)

            setattr(torch.Tensor, name, wrapper)

    global step

    def step(engine):
        loss = engine(batch)
        engine.backward(loss)
        engine.step()

    for _ in range(10):
        for e in engines.values():
            step(e)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
    times = {}
    profiles = {}
    for name, e in engines.items():
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        for _ in range(steps):
            active[0] = name
            prof.enable()
            step(e)
            prof.disable()
            active[0] = None
            if cuda:
                torch.cuda.synchronize()
        times[name] = (time.perf_counter() - t0) / steps
        profiles[name] = prof
    if cuda:
        torch.cuda.set_sync_debug_mode(0)
        gpu_timeline(engines, step, 5)
    print(f"per step: plain {times['plain'] * 1e3:.2f} ms, guarded {times['guarded'] * 1e3:.2f} ms "
          f"(ratio {times['guarded'] / times['plain']:.4f}; both under cProfile)")
    for name in ("plain", "guarded"):
        total = sum(sites[name].values())
        print(f"\nsync call sites, {name}: {total / steps:.1f} per step")
        for site, n in sites[name].most_common(25):
            print(f"  {n / steps:6.2f}/step  {site}")
    print("\nguarded: trainguard's and ds_plugins' functions by cumulative host time per step")
    st = pstats.Stats(profiles["guarded"])
    rows = []
    for (fn, line, func), (cc, nc, tt, ct, callers) in st.stats.items():
        if any(o in fn for o in OURS):
            rows.append((ct / steps, tt / steps, nc / steps, f"{fn.split('/')[-2]}/{fn.split('/')[-1]}:{line} {func}"))
    for ct, tt, nc, where in sorted(rows, reverse=True)[:40]:
        print(f"  cum {ct * 1e3:8.3f} ms  self {tt * 1e3:7.3f} ms  calls {nc:7.1f}  {where}")
    for e in engines.values():
        e.destroy()
    torch.distributed.destroy_process_group()
    return 0


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def gpu_timeline(engines, step, n: int) -> None:
    """torch.profiler over ``n`` steps of each engine: wall time, the GPU's kernel time and its idle time per
    step, and the guarded engine's extra kernels (by name, per step)."""
    from torch.profiler import ProfilerActivity, profile

    kernels = {}
    for name, e in engines.items():
        _sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(n):
                step(e)
            _sync()
            wall = (time.perf_counter() - t0) / n
        per = collections.Counter()
        counts = collections.Counter()
        busy = 0.0
        for ev in prof.key_averages():
            dev = getattr(ev, "self_device_time_total", None)
            if dev is None:
                dev = getattr(ev, "self_cuda_time_total", 0)
            if dev and ev.device_type == torch.autograd.DeviceType.CUDA:
                per[ev.key] += dev / n
                counts[ev.key] += ev.count / n
                busy += dev / n
        kernels[name] = (per, counts)
        print(f"timeline {name}: wall {wall * 1e3:.2f} ms/step, GPU kernels {busy / 1e3:.2f} ms/step, "
              f"GPU idle {wall * 1e3 - busy / 1e3:.2f} ms/step")
    per_g, cnt_g = kernels["guarded"]
    per_p, cnt_p = kernels["plain"]
    extra = sorted(((per_g[k] - per_p.get(k, 0.0), cnt_g[k] - cnt_p.get(k, 0.0), k) for k in per_g), reverse=True)
    print("guarded's extra GPU work per step (us, launches):")
    for us, c, k in extra[:12]:
        print(f"  {us:9.1f} us  {c:7.1f}  {k[:110]}")


def guard_overhead_args(argv):
    """guard_overhead's own parser, for the model's arguments."""
    import argparse

    ap = argparse.ArgumentParser()
    for flag, default in (("--d-model", 256), ("--layers", 4), ("--heads", 4), ("--seq", 128), ("--vocab", 512),
                          ("--batch", 8), ("--zero", 2)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--out", default="/tmp/guard-profile")
    ap.add_argument("--faults", default=None)
    args = ap.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    return args


if __name__ == "__main__":
    sys.exit(main())
