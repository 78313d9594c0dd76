"""The guard's cost on the GPU's critical path, read off the CPU (issue 52): counts, not times, that carry to a GPU.

    python bench/guard_overhead.py --proxies [--json FILE]      (or: python bench/guard_proxies.py)

One rank, DeepSpeed ZeRO-0 bf16, a plain engine and a guarded one (every default detector) over the same model, for
two models: 20 parameter tensors and 400 (a stack of small Linear layers), healthy steps only, after a warmup.
Printed on one line, each against its goal (exit 1 when one is missed):

- ``ops_small``, ``ops_large``: ATen ops the guard adds per healthy step (the guarded step's dispatched ops -- forward,
  backward, step, counted by a TorchDispatchMode -- minus the plain step's). Goal: the same for both, <= 30 (a handful
  of multi-tensor launches, whatever the number of parameters: on a GPU each op is a kernel launch or more);
- ``py_calls_per_param``: Python calls into trainguard and ds_plugins during the backward, per parameter tensor per
  micro-batch (a profile hook counts them): the slope between the two models, (calls at 400 - calls at 20) / 380 --
  what grows with the parameters; the fixed calls of a backward are printed beside it (``py_calls_per_backward``).
  Goal: 0 (no per-parameter Python on the healthy path);
- ``added_syncs``: host-synchronising tensor calls (``.item()``, ``.cpu()``, ``.tolist()``, ``bool()``, ``float()``,
  ``int()``) the guard adds per healthy step on the critical path, median, and where (the calling frames, printed): a
  read of the agreed row with framework ops dispatched between the row's launch and the read is behind them -- on a
  GPU the GPU runs them while the host reads (trainguard.step.launchgate) -- and printed, not counted. Goal: 0;
- ``decide_ms``: the guard's host time between the backward's end and the optimizer step's launch: its Python in
  ``engine.step()`` before DeepSpeed's own step begins (a wrapper marks that) plus its decision at the launch (timed
  around it), median, guarded minus plain. Goal: <= 0.2 ms. Timed directly: the difference of the two engines'
  windows from ``engine.step()`` to the inner optimizer's ``step()`` (``window_ms``, printed beside it) holds
  DeepSpeed's own ~1-14 ms of pre-step Python, which runs differently fast in the two engines. The whole
  ``engine.step()``'s difference, what runs after the launch included, is printed too (``step_ms``).

These are the proxies the issue names; the GPU figures (bench/gpu_check.sh) are what they stand for.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _single_rank import single_rank_env  # noqa: E402

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GOALS = {"ops": 30, "py_calls_per_param": 0, "added_syncs": 0, "decide_ms": 0.2}
SYNC_METHODS = ("item", "cpu", "tolist", "__bool__", "__float__", "__int__")
OURS = (str(ROOT / "trainguard"), str(ROOT / "ds_plugins"))
TORCH = str(Path(torch.__file__).parent)
GATE = str(ROOT / "trainguard" / "step" / "launchgate.py")


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


class Syncs:
    """Host-synchronising tensor calls while active, with the first frame of ours that made each. The guard's read
    of its agreed row (trainguard.step.agreement.Agreement.launch's returned call) is counted apart, as
    ``behind``, when the framework dispatched ops between the row's launch and its read: on a GPU those are queued
    behind what the read waits for, so the GPU runs them while the host reads and decides (not on the critical
    path; trainguard.step.launchgate); a read with nothing dispatched between drains the queue and counts."""

    def __init__(self):
        self.active, self.count, self.where, self.ours = False, 0, collections.Counter(), False
        self.ops = None          # the active OpCounter (dispatched ops, for the read's classification)
        self.behind = 0          # framework ops dispatched between the row's launch and the read now running
        self._orig = {}
        for name in SYNC_METHODS:
            orig = getattr(torch.Tensor, name)
            self._orig[name] = orig

            def wrapper(t, *a, _orig=orig, _name=name, **k):
                if self.active:
                    f = sys._getframe(1)  # (the first caller outside torch and the launch gate's pass-through)
                    while f is not None and (TORCH in f.f_code.co_filename or f.f_code.co_filename == GATE):
                        f = f.f_back
                    mine = f is not None and f.f_code.co_filename.startswith(OURS) and self.ours
                    hidden = mine and self.behind > 0
                    self.count += not hidden
                    if mine:
                        note = f" (behind {self.behind} framework ops)" if hidden else ""
                        self.where[f"{Path(f.f_code.co_filename).relative_to(ROOT)}:{f.f_lineno} .{_name}(){note}"] += 1
                return _orig(t, *a, **k)

            setattr(torch.Tensor, name, wrapper)
        from trainguard.step import agreement

        self._launch = launch = agreement.Agreement.launch

        def counted_launch(agreement_self, *a, **k):
            read = launch(agreement_self, *a, **k)
            at = self.ops.count if self.ops is not None else None

            def counted_read():
                self.behind = self.ops.count - at if self.ops is not None and at is not None else 0
                try:
                    return read()
                finally:
                    self.behind = 0
            return counted_read

        agreement.Agreement.launch = counted_launch

    def close(self):
        from trainguard.step import agreement

        for name, orig in self._orig.items():
            setattr(torch.Tensor, name, orig)
        agreement.Agreement.launch = self._launch


def model_of(tensors: int, width: int = 16) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(tensors // 2):  # (a Linear: a weight and a bias)
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return Net(torch.nn.Sequential(*layers))


class Net(torch.nn.Module):
    def __init__(self, body):
        super().__init__()
        self.body = body

    def forward(self, batch):
        return self.body(batch["x"]).pow(2).mean()


def engine_of(tensors: int, guarded: bool, out: Path, clipping: str = "deepspeed"):
    import deepspeed

    import ds_plugins

    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, "steps_per_print": 10 ** 9,
           "zero_optimization": {"stage": 0}, "bf16": {"enabled": True}}
    if guarded:
        cfg["trainguard"] = {"metrics": {"jsonl": str(out / f"proxies-{tensors}.jsonl"), "console": False},
                             "clipping": {"mode": clipping}}
    model = model_of(tensors)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    init = ds_plugins.initialize if guarded else deepspeed.initialize
    engine, _, _, _ = init(model=model, optimizer=opt, config=cfg)
    return engine


def _counted(i: int) -> bool:
    """Whether step ``i`` is counted (ops, syncs, calls) or timed: two of each in turn -- the counters' own Python
    would be in the times."""
    return i % 4 < 2


def measure(tensors: int, steps: int, warmup: int, out: Path, syncs: Syncs, clipping: str = "deepspeed") -> dict:
    engines = {"plain": engine_of(tensors, False, out), "guarded": engine_of(tensors, True, out, clipping)}
    g = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randn(4, 16, generator=g)} for _ in range(8)]
    ops = {k: [] for k in engines}
    sync = {k: [] for k in engines}
    step_s = {k: [] for k in engines}
    calls = []
    launched = {}

    def innermost(opt):
        while not isinstance(opt, torch.optim.Optimizer) and hasattr(opt, "optimizer"):
            opt = opt.optimizer
        return opt

    for name, eng in engines.items():  # (the inner optimizer's step: the launch of the update)
        innermost(eng.optimizer).register_step_pre_hook(
            lambda *a, name=name: launched.setdefault(name, time.perf_counter()) and None)
    launch_s = {k: [] for k in engines}
    own_s = {k: [] for k in engines}  # (the guard's own time in that window, timed directly: see decide_ms)
    marks = {}
    import deepspeed
    from trainguard.step import launchgate

    ds_step, gate_run = deepspeed.DeepSpeedEngine.step, launchgate.LaunchGate.run

    def base_step(self, *a, **k):  # (DeepSpeed's own step begins: what came before it in engine.step() is ours)
        marks.setdefault("base", time.perf_counter())
        return ds_step(self, *a, **k)

    def timed_run(self, decide, step):  # (the decision at the update's launch)
        def timed():
            t = time.perf_counter()
            try:
                return decide()
            finally:
                marks["gate"] = marks.get("gate", 0.0) + time.perf_counter() - t
        return gate_run(self, timed, step)
    deepspeed.DeepSpeedEngine.step, launchgate.LaunchGate.run = base_step, timed_run

    def ours_counting(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(OURS):
            calls[-1] += 1

    for i in range(warmup + steps):
        keep = i >= warmup
        counting = _counted(i)
        for name, eng in (engines.items() if i % 2 == 0 else reversed(list(engines.items()))):
            batch = {k: v.to(eng.device).to(torch.bfloat16) for k, v in batches[i % len(batches)].items()}
            counter = OpCounter()
            syncs.count, syncs.active, syncs.ours = 0, keep and counting, name == "guarded"
            syncs.ops = counter if counting else None
            with counter if counting else contextlib.nullcontext():
                loss = eng(batch)
                if name == "guarded" and keep and counting:
                    calls.append(0)
                    sys.setprofile(ours_counting)
                eng.backward(loss)
                sys.setprofile(None)
                launched.pop(name, None)
                marks.clear()
                t0 = time.perf_counter()
                eng.step()
                dt = time.perf_counter() - t0
            syncs.active = False
            if keep and counting:
                ops[name].append(counter.count)
                sync[name].append(syncs.count)
            elif keep:
                step_s[name].append(dt)
                launch_s[name].append(launched.get(name, float("nan")) - t0)
                own_s[name].append(marks.get("base", t0) - t0 + marks.get("gate", 0.0))
    deepspeed.DeepSpeedEngine.step, launchgate.LaunchGate.run = ds_step, gate_run
    n = sum(1 for p in engines["plain"].module.parameters() if p.requires_grad)
    for eng in engines.values():
        eng.destroy()
    return {"tensors": n, "ops": statistics.median(ops["guarded"]) - statistics.median(ops["plain"]),
            "py_calls": statistics.median(calls),
            "added_syncs": statistics.median(sync["guarded"]) - statistics.median(sync["plain"]),
            "decide_ms": round((statistics.median(own_s["guarded"]) - statistics.median(own_s["plain"])) * 1e3, 3),
            "window_ms": round((statistics.median(launch_s["guarded"]) - statistics.median(launch_s["plain"])) * 1e3, 3),
            "step_ms": round((statistics.median(step_s["guarded"]) - statistics.median(step_s["plain"])) * 1e3, 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--out", default="bench-out")
    ap.add_argument("--json", help="keep the figures here (bench/_results.keep: date, commit, clean)")
    ap.add_argument("--clipping", default="deepspeed", choices=("deepspeed", "norm", "adaptive"),
                    help="the guarded engine's clipping.mode (adaptive: decided at the step's start, not at the "
                         "update's launch -- trainguard.step.launchgate)")
    args = ap.parse_args(argv)
    single_rank_env(29700)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    syncs = Syncs()
    try:
        counted = sum(map(_counted, range(args.warmup, args.warmup + args.steps)))  # (steps whose syncs were counted)
        small = measure(20, args.steps, args.warmup, out, syncs, args.clipping)
        where_small = dict(syncs.where)
        syncs.where.clear()
        large = measure(400, args.steps, args.warmup, out, syncs, args.clipping)
    finally:
        syncs.close()
    figures = {"ops_small": small["ops"], "ops_large": large["ops"],
               "py_calls_per_param": round(max(0.0, large["py_calls"] - small["py_calls"]) / (
                   large["tensors"] - small["tensors"]), 3),
               "py_calls_per_backward": small["py_calls"],
               "added_syncs": max(small["added_syncs"], large["added_syncs"]),
               "decide_ms": max(small["decide_ms"], large["decide_ms"]),
               "window_ms": [small["window_ms"], large["window_ms"]],
               "step_ms": max(small["step_ms"], large["step_ms"]),
               "tensors": [small["tensors"], large["tensors"]], "steps": args.steps, "device": "cpu",
               "torch": torch.__version__, "clipping": args.clipping, "sync_sites": {k: v / counted for k, v in where_small.items()},
               "goals": GOALS}
    missed = [k for k, ok in (
        ("ops", figures["ops_small"] == figures["ops_large"] <= GOALS["ops"]),
        ("py_calls_per_param", figures["py_calls_per_param"] <= GOALS["py_calls_per_param"]),
        ("added_syncs", figures["added_syncs"] <= GOALS["added_syncs"]),
        ("decide_ms", figures["decide_ms"] <= GOALS["decide_ms"])) if not ok]
    figures["missed"] = missed
    print(f"proxies: ops_small={figures['ops_small']:g} ops_large={figures['ops_large']:g} "
          f"py_calls_per_param={figures['py_calls_per_param']:g} added_syncs={figures['added_syncs']:g} "
          f"decide_ms={figures['decide_ms']:g}")
    print(f"  beside them: py_calls_per_backward={figures['py_calls_per_backward']:g} (fixed, whatever the "
          f"parameters) step_ms={figures['step_ms']:g} (the whole engine.step() beyond plain's) window_ms="
          f"{'/'.join(map(str, figures['window_ms']))} (20/400 tensors: engine.step() to the launch, guarded minus "
          f"plain -- DeepSpeed's own time in it varies between two engines)")
    print(f"  goals: ops the same for 20 and 400 tensors and <= {GOALS['ops']}; py_calls_per_param "
          f"{GOALS['py_calls_per_param']}; added_syncs {GOALS['added_syncs']}; decide_ms <= {GOALS['decide_ms']}"
          f" -- {'met' if not missed else 'missed: ' + ', '.join(missed)}")
    for site, per_step in sorted(figures["sync_sites"].items(), key=lambda kv: -kv[1]):
        print(f"  sync per healthy step: {per_step:g} at {site}")
    if args.json:
        from bench._results import keep

        keep(args.json, figures)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
