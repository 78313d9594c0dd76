"""Silent data corruption trials (issue 26's goals for the replica check), on real DeepSpeed engines.

    python bench/sdc_trials.py [--flips 20] [--every 5] [--healthy 1000] [--out DIR]

1. Detection: ``--flips`` bitflips, one at a time, each on a rank drawn at random of 3 data-parallel replicas
   (ZeRO-0: every rank keeps its own full parameters), a random low mantissa bit of the first parameter, one
   flip every 4 x ``--every`` steps; ``detectors.replica_check`` every ``--every`` steps. A flip counts as found
   when a ``replica_mismatch`` names exactly the flipped rank (3 replicas: a majority to tell which) within
   ``--every`` steps of it; each is followed by a rollback, so the next flip starts from agreeing replicas.
2. False verdicts: ``--healthy`` steps with no fault at ZeRO 0, 1 and 2 (2 ranks, dropout 0.1), both checks on
   every step: any ``replica_mismatch`` or ``compute_mismatch`` is a false verdict.

3. Compute trials (the peer replay): ``--computes`` ``sdc_compute`` faults, one at a time, each on a rank drawn
   at random of 3 replicas, on a sampled step (every ``--every``), the output of a random layer's first MLP
   projection x (1 + ``--eps``); ``detectors.peer_replay`` every ``--every`` steps. A trial counts when a
   ``compute_mismatch`` names exactly that rank on that step.
4. False verdicts on megatron-core (DDP, DP=2, the replayer): ``--healthy`` iterations with both checks on every
   iteration (``--megatron 0`` leaves it out; it needs megatron-core); and in Megatron-LM's own loop (its
   pretrain_gpt.py, DP=2: ``--megatron-lm 0`` leaves it out; it needs ../shared/third_party's checkout).
   Part 2 runs fp32 at ZeRO 0, 1, 2 and bf16 at ZeRO-2 (the shipped config's), all with dropout 0.1.

    python bench/sdc_trials.py [--flips 20] [--computes 20] [--eps 1e-3] [--every 5] [--healthy 1000] [--out DIR]
                               [--json bench/results/sdc-DATE.json]

Prints one line per part and exits 0 when every fault was found and its rank named and there was no false
verdict.
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
from pathlib import Path

from trainguard.demo.run import run_worker
from trainguard.metrics.jsonl import read


def _config(path: Path, block: dict, stage: int) -> Path:
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
                                "gradient_clipping": 1.0, "steps_per_print": 10 ** 6,
                                "zero_optimization": {"stage": stage}, "trainguard": block}))
    return path


def detection(out: Path, flips: int, every: int, seed: int) -> tuple[int, int, list]:
    rng = random.Random(seed)
    gap = 4 * every
    plan = [{"type": "bitflip", "step": gap * (i + 1) + rng.randrange(1, every), "rank": rng.randrange(3),
             "bit": rng.randrange(8, 20)} for i in range(flips)]
    steps = gap * (flips + 1)
    block = {"allow_faults": True, "faults": plan, "checks": {"enabled": False},
             "detectors": {"replica_check": {"enabled": True, "every_steps": every}},
             "checkpoint": {"dir": str(out / "ck"), "every_steps": every, "stable_after": 1, "verify_steps": 0,
                            "keep_last": 4},
             "recovery": {"replay_check": False, "max_rollbacks": 10 * flips, "rollback_window": 10}}
    out.mkdir(parents=True, exist_ok=True)
    rc, _ = run_worker(_config(out / "ds_config.json", block, 0), out / "run", steps, nproc=3, timeout=60 * flips)
    found = [e for e in read(out / "run" / "trainguard.jsonl") if e.get("event") == "replica_mismatch"]
    hits, rows = 0, []
    for f in plan:
        near = [e for e in found if f["step"] <= e["step"] < f["step"] + every + 1]
        ok = bool(near) and near[0]["ranks"] == [f["rank"]]
        hits += ok
        rows.append({"flip_step": f["step"], "rank": f["rank"], "bit": f["bit"],
                     "found_at": near[0]["step"] if near else None, "named": near[0]["ranks"] if near else None})
    return rc, hits, rows


def false_verdicts(out: Path, healthy: int) -> dict:
    """fp32 at ZeRO 0, 1 and 2, and bf16 at ZeRO-2 (what configs/ turns both checks on in), dropout 0.1."""
    counts = {}
    for stage, dtype in ((0, "fp32"), (1, "fp32"), (2, "fp32"), (2, "bf16")):
        d = out / f"zero{stage}-{dtype}"
        d.mkdir(parents=True, exist_ok=True)
        block = {"checks": {"enabled": False}, "detectors": {"replica_check": {"enabled": True, "every_steps": 1},
                                                             "peer_replay": {"enabled": True, "every_steps": 1}}}
        rc, _ = run_worker(_config(d / "ds_config.json", block, stage), d / "run", healthy, nproc=2, timeout=3600,
                           extra=["--dropout", "0.1", "--dtype", dtype])
        events = read(d / "run" / "trainguard.jsonl")
        counts[f"zero{stage}-{dtype}"] = {"rc": rc, "checks": healthy, "false_verdicts": sum(
            1 for e in events if e.get("event") in ("replica_mismatch", "compute_mismatch"))}
    return counts


def computes(out: Path, trials: int, every: int, eps: float, seed: int) -> tuple[int, int, list]:
    rng = random.Random(seed + 1)
    gap = 4 * every
    plan = [{"type": "sdc_compute", "step": gap * (i + 1) + every, "rank": rng.randrange(3), "eps": eps,
             "module": f"blocks.{rng.randrange(3)}.mlp.0"} for i in range(trials)]
    block = {"allow_faults": True, "faults": plan, "checks": {"enabled": False},
             "detectors": {"peer_replay": {"enabled": True, "every_steps": every}},
             "recovery": {"max_rollbacks": 10 * trials}}
    out.mkdir(parents=True, exist_ok=True)
    rc, _ = run_worker(_config(out / "ds_config.json", block, 0), out / "run", gap * (trials + 1), nproc=3,
                       timeout=60 * trials)
    found = [e for e in read(out / "run" / "trainguard.jsonl") if e.get("event") == "compute_mismatch"]
    hits, rows = 0, []
    for f in plan:
        at = [e for e in found if e["step"] == f["step"]]
        hits += bool(at) and at[0]["ranks"] == [f["rank"]]
        rows.append({"step": f["step"], "rank": f["rank"], "module": f["module"],
                     "named": at[0]["ranks"] if at else None})
    false = [e["step"] for e in found if e["step"] not in {f["step"] for f in plan}]
    return rc, hits, rows + ([{"false_verdicts_at": false}] if false else [])


def megatron_false_verdicts(out: Path, healthy: int) -> dict:
    block = {"checks": {"enabled": False},
             "detectors": {"replica_check": {"enabled": True, "every_steps": 1},
                           "peer_replay": {"enabled": True, "every_steps": 1}}}
    out.mkdir(parents=True, exist_ok=True)
    (out / "block.json").write_text(json.dumps(block))
    rc, _ = run_worker(out / "block.json", out / "run", healthy, nproc=2, extra=["--replay"],
                       module="tests.support.megatron_worker", timeout=3600)
    events = read(out / "run" / "trainguard.jsonl")
    return {"rc": rc, "iterations": healthy,
            "false_verdicts": sum(1 for e in events if e.get("event") in ("replica_mismatch", "compute_mismatch"))}


def megatron_lm_false_verdicts(out: Path, iterations: int) -> dict:
    """Megatron-LM's own loop (its unmodified pretrain_gpt.py under ``trainguard run``, DP=2 with dropout, the launch
    the tests use): both checks every iteration."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.dist.test_megatron_lm_dist import Release, launch

    block = {"checks": {"enabled": False},
             "detectors": {"replica_check": {"enabled": True, "every_steps": 1},
                           "peer_replay": {"enabled": True, "every_steps": 1}}}
    out.mkdir(parents=True, exist_ok=True)
    run = launch(Release("core_v0.19.0"), out, "run", "dp", block, ["--train-iters", str(iterations)],
                 timeout=3600)
    verdicts = [e for e in run.lines if e.get("event") in ("replica_mismatch", "compute_mismatch")]
    return {"rc": run.rc, "iterations": max(run.iterations, default=0), "false_verdicts": len(verdicts)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flips", type=int, default=20)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--healthy", type=int, default=1000)
    ap.add_argument("--computes", type=int, default=20)
    ap.add_argument("--eps", type=float, default=1e-3)
    ap.add_argument("--megatron", type=int, default=1, help="1: the megatron-core false-verdict part too")
    ap.add_argument("--seed", type=int, default=26)
    ap.add_argument("--megatron-lm", type=int, default=1, help="1: Megatron-LM's loop too (needs ../shared/third_party)")
    ap.add_argument("--out", default="trainguard-sdc")
    ap.add_argument("--json", default=None, help="keep every part's figures, with the date and commit, in this file")
    args = ap.parse_args(argv)
    out = Path(args.out)
    runs = {"flips": True, "healthy": args.healthy, "computes": args.computes, "megatron": args.megatron and args.healthy,
            "megatron-lm": args.megatron_lm and args.healthy}
    for part in (p for p, on in runs.items() if on):  # (fresh: a run's JSONL is appended to, and an earlier run's
        shutil.rmtree(out / part, ignore_errors=True)  # would be read; the parts not run this time are left as they are)
    rc, hits, rows = detection(out / "flips", args.flips, args.every, args.seed)
    print(json.dumps({"part": "detection", "rc": rc, "flips": args.flips, "found_and_named": hits,
                      "every_steps": args.every, "trials": rows}))
    healthy = false_verdicts(out / "healthy", args.healthy) if args.healthy else {}
    print(json.dumps({"part": "false_verdicts", "by_zero_stage": healthy}))
    crc, chits, crows = computes(out / "computes", args.computes, args.every, args.eps, args.seed) \
        if args.computes else (0, 0, [])
    print(json.dumps({"part": "computes", "rc": crc, "trials": args.computes, "named": chits, "eps": args.eps,
                      "every_steps": args.every, "rows": crows}))
    mega = megatron_false_verdicts(out / "megatron", args.healthy) if args.megatron and args.healthy else {}
    print(json.dumps({"part": "megatron_false_verdicts", **mega}))
    lm = megatron_lm_false_verdicts(out / "megatron-lm", args.healthy) if args.megatron_lm and args.healthy else {}
    print(json.dumps({"part": "megatron_lm_false_verdicts", **lm}))
    ok = rc == 0 and hits == args.flips and all(v["rc"] == 0 and v["false_verdicts"] == 0 for v in healthy.values())
    ok = ok and crc == 0 and chits == args.computes and not any("false_verdicts_at" in r for r in crows)
    ok = ok and all(not m or (m["rc"] == 0 and m["false_verdicts"] == 0) for m in (mega, lm))
    if args.json:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from bench._results import keep

        keep(args.json, {
            "args": vars(args), "met": ok,
            "detection": {"rc": rc, "flips": args.flips, "found_and_named": hits, "trials": rows},
            "false_verdicts": healthy, "computes": {"rc": crc, "trials": args.computes, "named": chits, "rows": crows},
            "megatron_false_verdicts": mega, "megatron_lm_false_verdicts": lm})
    print("goals: " + ("met" if ok else "MISSED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
