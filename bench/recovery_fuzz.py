"""Recovery fuzzing: every action the policy can take, forced at random steps on every stack, and the run must live.

    python bench/recovery_fuzz.py --draws 200 [--seed 0] [--json bench/results/recovery-fuzz-<date>.json]
    python bench/recovery_fuzz.py --sample          # one seeded draw per stack (CI's selection runs this)

A draw is a stack, one or two ``force_action`` faults (skip; rollback to the target recovery.rollback_to names, to
the newest, to the newest stable; a restart from the first step's checkpoint; an LR cut; the bf16 fallback on fp16
stacks) at drawn steps -- step 1, the step after the first checkpoint, fp16's loss-scale search (the fp16 stacks
overflow their first three steps, as a scale search does, so the first step's checkpoint holds no update), a
gradient-accumulation boundary (DeepSpeed stacks with accumulation), any step, and a second action a few steps after
a first one's rollback or restart. The run is healthy but for what is forced: its framework would finish it, so any
run that does not reach its last step with finite weights -- a crash, a hang, trainguard's own abort -- is a death
caused by trainguard (``deaths_by_trainguard``).

Stacks: DeepSpeed's own loop (the demo's TinyGPT) at ZeRO 0-3 in fp16 and bf16, with and without gradient
accumulation; HF's Trainer under ``trainguard run --`` (ZeRO-2 bf16); a megatron-core loop (tests/support's worker)
at TP=2 fp16, PP=2 bf16 and DP=2 with the distributed optimizer in fp16; Megatron-LM's unmodified pretrain_gpt.py
(core_v0.19.0) at TP=2 fp16 and PP=2 bf16. Goal: >= 200 draws (--draws), 0 deaths. Keeps its JSON (``draws``,
``deaths_by_trainguard``, every draw) and exits 1 when a death happened or fewer draws than asked ran.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._results import keep  # noqa: E402
from trainguard.demo.run import run_bounded, run_worker  # noqa: E402

STEPS, EVERY = 16, 4
ACTIONS = ["skip", "rollback", "rollback_newest", "rollback_stable", "restart", "lr_cut", "bf16_fallback"]
TIMEOUT = 300


def _ds(stage: int, dtype: str, accumulation: int = 1) -> dict:
    return {"kind": "deepspeed", "stage": stage, "dtype": dtype, "accumulation": accumulation}


STACKS = {
    **{f"ds-z{z}-{d}": _ds(z, d) for z in (0, 1, 2, 3) for d in ("fp16", "bf16")},
    "ds-z2-bf16-ga2": _ds(2, "bf16", 2), "ds-z1-fp16-ga2": _ds(1, "fp16", 2),
    "hf-z2-bf16": {"kind": "hf", "dtype": "bf16"},
    "mcore-tp-fp16": {"kind": "mcore", "layout": ["--tp", "2"], "dtype": "fp16"},
    "mcore-pp-bf16": {"kind": "mcore", "layout": ["--pp", "2"], "dtype": "bf16"},
    "mcore-dp-distopt-fp16": {"kind": "mcore", "layout": ["--dist-opt"], "dtype": "fp16"},
    "mlm-tp-fp16": {"kind": "mlm", "layout": ["--tensor-model-parallel-size", "2"], "dtype": "fp16"},
    "mlm-pp-bf16": {"kind": "mlm", "layout": ["--pipeline-model-parallel-size", "2"], "dtype": "bf16"},
}


def draw(rng: random.Random, stack: str) -> dict:
    """One draw on ``stack``: its forced actions and where."""
    s = STACKS[stack]
    # (bf16_fallback: fp16 stacks; not DeepSpeed ZeRO-3, whose fp16 engine cannot be re-created in place -- that rung
    # is a named abort by design, reached only where fp16 at its floor stops DeepSpeed itself: test_recovery_dist)
    actions = [a for a in ACTIONS if a != "bf16_fallback" or (s["dtype"] == "fp16" and s.get("stage") != 3)]
    where = rng.choice(["first", "after_first_checkpoint", "scale_search" if s["dtype"] == "fp16" else "any",
                        "accumulation_boundary" if s.get("accumulation", 1) > 1 else "any", "any"])
    step = {"first": 1, "after_first_checkpoint": EVERY + 1, "scale_search": rng.randint(1, 3),
            "accumulation_boundary": rng.randint(2, STEPS - 4), "any": rng.randint(1, STEPS - 3)}[where]
    forced = [{"step": step, "action": rng.choice(actions)}]
    if rng.random() < 0.4 and step + 2 < STEPS:  # a second one, a few steps after the first's recovery
        forced.append({"step": rng.randint(step + 1, min(step + 3, STEPS - 1)), "action": rng.choice(actions)})
    return {"stack": stack, "where": where, "forced": forced}


def block(d: dict, out: Path) -> dict:
    s = STACKS[d["stack"]]
    faults = [{"type": "force_action", **f} for f in d["forced"]]
    if s["dtype"] == "fp16":  # (the loss scale's search: the first steps overflow and are skipped)
        faults.insert(0, {"type": "fp16_overflow", "step": 1, "steps": 3, "rank": 1})
    return {"allow_faults": True, "faults": faults, "checks": {"enabled": False},
            "checkpoint": {"dir": str(out / "ck"), "every_steps": EVERY, "stable_after": 2, "first_step": True},
            "metrics": {"jsonl": str(out / "trainguard.jsonl")}}


def run_deepspeed(d: dict, out: Path, hf: bool = False) -> dict:
    s = STACKS[d["stack"]]
    cfg = {"train_micro_batch_size_per_gpu": 4 if not hf else 8, "gradient_accumulation_steps": s.get("accumulation", 1),
           "gradient_clipping": 1.0, "steps_per_print": 10 ** 9, "zero_optimization": {"stage": s.get("stage", 2)},
           s["dtype"]: {"enabled": True, **({"initial_scale_power": 16, "hysteresis": 1, "min_loss_scale": 1}
                                            if s["dtype"] == "fp16" else {})},
           "trainguard": block(d, out)}
    path = out / "ds_config.json"
    path.write_text(json.dumps(cfg))
    if hf:
        rc, results = run_worker(path, out, STEPS, module="bench.natural.hf_train", timeout=TIMEOUT,
                                 prefix=(str(Path(sys.executable).parent / "trainguard"), "run", "--"),
                                 extra=["--warmup", "2"])
        ok = rc == 0 and all(r and r.get("global_steps") == STEPS and r.get("eval_loss") is not None
                             for r in results)
    else:
        rc, results = run_worker(path, out, STEPS, timeout=TIMEOUT)
        ok = rc == 0 and all(r and r.get("global_steps") == STEPS and r.get("weights_finite") for r in results)
    return {"rc": rc, "lived": ok, "why": _why(out, results, rc)}


def run_mcore(d: dict, out: Path) -> dict:
    s = STACKS[d["stack"]]
    (out / "tg.json").write_text(json.dumps(block(d, out)))
    rc, results = run_worker(out / "tg.json", out, STEPS, module="tests.support.megatron_worker", timeout=TIMEOUT,
                             extra=[*s["layout"], f"--{s['dtype']}"])
    ok = rc == 0 and all(r and r.get("weights_finite") for r in results)
    return {"rc": rc, "lived": ok, "why": _why(out, results, rc)}


def run_mlm(d: dict, out: Path) -> dict:
    from bench.natural.megatron_lm import CHECKOUT, LINE, TINY

    s = STACKS[d["stack"]]
    (out / "tg.json").write_text(json.dumps({"trainguard": block(d, out)}))
    bin_ = Path(sys.executable).parent
    at = TINY.index("--tensor-model-parallel-size")
    tiny = TINY[:at] + TINY[at + 2:]  # (the stack's layout instead)
    scale = ["--fp16", "--initial-loss-scale", "65536"] if s["dtype"] == "fp16" else ["--bf16"]
    command = [str(bin_ / "trainguard"), "run", "--", str(bin_ / "torchrun"), "--standalone", "--nproc-per-node", "2",
               str(CHECKOUT / "pretrain_gpt.py"), *tiny, *s["layout"], *scale, "--lr", "1e-3", "--lr-warmup-iters",
               "2", "--train-iters", str(STEPS), "--trainguard-config", str(out / "tg.json")]
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1", TRAINGUARD_TEST_ROOT=str(ROOT),
               PYTHONPATH=os.pathsep.join([str(ROOT / "tests" / "support" / "megatron_lm_site"), str(CHECKOUT),
                                           str(ROOT)]), TRAINGUARD_TEST_RUN=f"{out}:{uuid.uuid4().hex}")
    with open(out / "megatron.log", "w") as log:
        rc, _, _ = run_bounded(command, TIMEOUT, cwd=out, env=env, stdout=log, stderr=subprocess.STDOUT)
    text = (out / "megatron.log").read_text(errors="replace")
    iters = {int(m[1]): m[3] for m in LINE.finditer(text)}
    losses = [float(v) for v in iters.values() if v is not None]
    ok = rc == 0 and max(iters, default=0) == STEPS and all(x == x and abs(x) != float("inf") for x in losses)
    return {"rc": rc, "lived": ok, "why": _why(out, [], rc, text)}


def _why(out: Path, results: list, rc: int, text: str = "") -> str | None:
    """How a run that did not live ended: trainguard's abort (its reason), else the last error its ranks logged."""
    jsonl = out / "trainguard.jsonl"
    if jsonl.exists():
        for line in jsonl.read_text().splitlines():
            x = json.loads(line)
            if x.get("event") == "abort":
                return "trainguard abort: " + str(x["detail"].get("reason"))[:300]
    for r in results:
        if r and (r.get("died") or r.get("aborted")):
            return str(r.get("died") or r.get("aborted"))[:300]
    log = text or ((out / "torchrun.log").read_text(errors="replace") if (out / "torchrun.log").exists() else "")
    errors = [x for x in log.splitlines() if "Error" in x or "Exception" in x]
    return (errors[-1].strip()[:300] if errors else f"exit {rc}") if rc else None


def recoveries(out: Path) -> dict:
    """What trainguard did about what was forced (from its log): rollbacks, failed recoveries, saves that failed."""
    jsonl = out / "trainguard.jsonl"
    lines = [json.loads(x) for x in jsonl.read_text().splitlines()] if jsonl.exists() else []
    count = {k: sum(1 for x in lines if x.get("event") == k)
             for k in ("rollback", "rollback_unavailable", "recovery_failed", "checkpoint_failed", "precision_fallback")}
    count["forced"] = sum(1 for x in lines if x.get("event") == "fault_injected" and "force_action" in json.dumps(x))
    return count


def available(stack: str) -> str | None:
    kind = STACKS[stack]["kind"]
    if kind == "mlm":
        from bench.natural.megatron_lm import available as lm

        return lm()
    if kind == "mcore":
        import importlib.util

        return None if importlib.util.find_spec("megatron") and importlib.util.find_spec("megatron.core") else \
            "megatron-core is not installed"
    if kind == "hf":
        import importlib.util

        return None if importlib.util.find_spec("transformers") else "transformers is not installed"
    return None


def one(d: dict, work: Path) -> dict:
    out = work / f"{len(list(work.iterdir())):04d}-{d['stack']}"
    out.mkdir(parents=True)
    t0 = time.time()
    kind = STACKS[d["stack"]]["kind"]
    got = {"deepspeed": run_deepspeed, "hf": lambda d, o: run_deepspeed(d, o, hf=True), "mcore": run_mcore,
           "mlm": run_mlm}[kind](d, out)
    return {**d, **got, "seconds": round(time.time() - t0, 1), "trainguard": recoveries(out), "out": str(out)}


def _forced(d: dict) -> str:
    return " ".join(f"{f['action']}@{f['step']}" for f in d["forced"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draws", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sample", action="store_true", help="one seeded draw per stack (CI's selection)")
    ap.add_argument("--stacks", help="comma-separated subset of: " + ", ".join(STACKS))
    ap.add_argument("--json", help="where to keep the JSON (default bench/results/recovery-fuzz-<date>.json; "
                                   "--sample keeps none unless asked)")
    ap.add_argument("--keep-runs", action="store_true", help="keep every run's folder (default: only the deaths')")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    stacks = args.stacks.split(",") if args.stacks else list(STACKS)
    unknown = [s for s in stacks if s not in STACKS]
    if unknown:
        ap.error(f"unknown stack(s) {unknown}; the stacks are {list(STACKS)}")
    missing = {s: why for s in stacks if (why := available(s))}
    if missing:
        print(f"recovery_fuzz: cannot run {missing}", file=sys.stderr)
        return 1
    plan = [draw(rng, s) for s in stacks] if args.sample else [draw(rng, rng.choice(stacks)) for _ in range(args.draws)]
    work = Path(tempfile.mkdtemp(prefix="recovery-fuzz-"))
    done = []
    for i, d in enumerate(plan):
        r = one(d, work)
        done.append(r)
        print(f"[{i + 1}/{len(plan)}] {r['stack']:<22} {r['where']:<22} "
              f"{_forced(r):<34} "
              f"{'lived' if r['lived'] else 'DIED: ' + str(r['why'])} ({r['seconds']} s)", flush=True)
        if r["lived"] and not args.keep_runs:
            shutil.rmtree(r["out"], ignore_errors=True)
    deaths = [r for r in done if not r["lived"]]
    goal_draws = len(plan) if args.sample else args.draws
    figures = {"draws": len(done), "deaths_by_trainguard": len(deaths), "seed": args.seed, "sample": args.sample,
               "steps_per_run": STEPS, "stacks": {s: sum(1 for r in done if r["stack"] == s) for s in stacks},
               "actions": {a: sum(1 for r in done for f in r["forced"] if f["action"] == a) for a in ACTIONS},
               "goal": {"draws": goal_draws, "deaths_by_trainguard": 0},
               "every_draw": done}
    path = args.json or (None if args.sample else
                         ROOT / "bench" / "results" / f"recovery-fuzz-{datetime.date.today().isoformat()}.json")
    if path:
        keep(path, figures)
    print(f"recovery_fuzz: {len(done)} draws, {len(deaths)} deaths caused by trainguard"
          + (f" (kept: {path})" if path else "") + (f"; the deaths' runs in {work}" if deaths else ""))
    return 1 if deaths or len(done) < goal_draws else 0


if __name__ == "__main__":
    sys.exit(main())
