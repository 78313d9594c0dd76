"""The guard's cost per step against the number of ranks, by simulation (issue 37).

One process plays rank 0 of a world of 8 to 65,536 ranks: a real StepGuard (default detectors, a real JSONL log)
runs the whole step -- LOSS, BACKWARD, AGREE, DECIDE, STEP, END: agree, decide, log -- while the collectives are
replaced by their results (:class:`SimCollective`: the other ranks' rows are a synthetic table; the time it takes to
compute what a real all-reduce would hand back is not the guard's and is subtracted). Printed per world, for the
summary way every world above 64 ranks takes now (trainguard.step.agreement) and for the table way every world took
before (forced here, in the same run), : the median host time of a healthy step, the bytes each rank all-reduces
on it, and the host time of an anomalous step (one rank's loss non-finite: named with its coordinates, samples and
first bad module, checked).

Goals (issue 37), at 65,536 ranks: healthy step <= 2 ms and <= 4 KB reduced per rank; anomalous step <= 50 ms.
Exit 1 when a goal is missed (``--no-check`` to only print).

    python bench/scale.py [--worlds 8,64,1024,16384,65536] [--steps 40] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainguard.step.agreement import Agreement  # noqa: E402
from trainguard.config import parse_block  # noqa: E402
from trainguard.events import Action  # noqa: E402
from trainguard.step.guard import StepGuard  # noqa: E402
from trainguard.ranks.isolation import FIELDS, F, RankCoords  # noqa: E402
from trainguard.ranks.reduced import contribution, rank_bits  # noqa: E402

GOALS = {"healthy_ms": 2.0, "bytes": 4096, "anomalous_ms": 50.0}
MODULE = "blocks.3.mlp.0"


class SimCollective:
    """The collectives' results for rank 0 of ``world`` ranks whose rows are a synthetic table (healthy: losses
    and norms near rank 0's, compute times around 0.1 s). ``bad``: a rank whose loss is NaN on ``bad_step``."""

    def __init__(self, world: int, columns: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.world, self.sim_s = world, 0.0
        t = torch.zeros(world, columns, dtype=torch.float64)
        t[:, F["micro_batches"]] = 1
        t[:, F["loss_sum"]] = 2.0 + 0.05 * torch.randn(world, generator=g, dtype=torch.float64)
        t[:, F["grad_checked"]] = 4
        t[:, F["grad_sq"]] = 9.0 * (1 + 0.05 * torch.randn(world, generator=g, dtype=torch.float64))
        t[:, F["clock"]] = time.time()
        t[:, F["compute_s"]] = 0.1 * (1 + 0.02 * torch.rand(world, generator=g, dtype=torch.float64))
        t[:, F["lr"]] = 1e-3
        t[:, F["prev_grad_norm"]] = 3.0
        t[:, F["prev_applied_sq"]] = 9.0 / world
        if columns > len(FIELDS):
            t[:, len(FIELDS):] = float("nan")
        self.others = t
        self.bad: int | None = None   # a rank whose loss is NaN at the coming step
        self._reduced: dict = {}

    def _world(self, row: torch.Tensor) -> torch.Tensor:
        t = self.others.clone()
        t[0] = row.reshape(-1)
        t[:, F["clock"]] = row.reshape(-1)[F["clock"]]
        if self.bad is not None:
            t[self.bad, F["loss_sum"]] = float("nan")
            t[self.bad, F["loss_nonfinite"]] = 1
        return t

    def table(self, row):
        t0 = time.perf_counter()
        out = self._world(row)
        self.sim_s += time.perf_counter() - t0
        return out

    def reduce(self, sums, keys):
        t0 = time.perf_counter()
        # (rank 0's own contribution is what the guard computed; the rest is what the others add, worked out once
        # per kind of step: a simulation that swept megabytes every step would evict the guard's caches)
        if self.bad not in self._reduced:
            t = self._world(torch.zeros(self.others.shape[1], dtype=torch.float64))
            s, k = contribution(t[1:], torch.arange(1, self.world), 1.0, 1.0, rank_bits(self.world))
            self._reduced[self.bad] = (s.sum(0), k.max(0).values)
        s, k = self._reduced[self.bad]
        out = sums + s, torch.maximum(keys, k) if self.world > 1 else keys
        self.sim_s += time.perf_counter() - t0
        return out

    def objects(self, obj, ranks=None):
        t0 = time.perf_counter()
        ranks = range(self.world) if ranks is None else ranks
        out = {r: obj if r == 0 else {"sample_ids": [r * 10, r * 10 + 1], "rejected": [], "position": None,
                                      "localized": {"module": MODULE if r == self.bad else None},
                                      "activation": None, "entropy": None, "replayed": None, "narrowed": None,
                                      "micro_batches": 1} for r in ranks}
        self.sim_s += time.perf_counter() - t0
        return out


def run(world: int, way: str, steps: int, tmp: Path) -> dict:
    cfg = parse_block({"metrics": {"jsonl": str(tmp / f"{way}{world}.jsonl")}, "checks": {"enabled": False}})
    grads = [torch.full((64,), 0.75) for _ in range(4)]
    guard = StepGuard(cfg, rank=0, world=world, localize=lambda: {"module": None})
    sim = SimCollective(world, len(FIELDS) + len(guard.agreement.extra))
    guard.agreement = guard.evidence.agreement = Agreement(0, world, torch.device("cpu"), collective=sim,
                                                           extra=guard.agreement.extra,
                                                           up_to=world if way == "table" else 64)
    guard.on_begin([RankCoords(r, r, 0, 0, f"node{r // 8}", r % 8) for r in range(world)], {"framework": "sim"})
    bad_step = steps + 1
    healthy, anomalous, record = [], None, None
    for step in range(1, bad_step + 1):
        sim.bad = world - 1 if step == bad_step else None
        sim.sim_s = 0.0
        t0 = time.perf_counter()
        guard.on_batch([0, 1], None)
        guard.on_loss(step, torch.tensor(2.0))
        for g in grads:
            guard.on_backward(g)
        view = guard.on_agree(step)
        decision = guard.on_decide(step, view)
        guard.on_step(step, decision, applied=decision.action is Action.CONTINUE)
        guard.on_end(step, view, {"grad_norm": 3.0, "lr": 1e-3, "loss_scale": 1.0, "skipped_steps": 0})
        took = (time.perf_counter() - t0 - sim.sim_s) * 1e3
        if step == bad_step:
            anomalous = took
            if decision.action is not Action.SKIP_STEP:
                raise AssertionError(f"world {world}: the non-finite step was not skipped: {decision.action}")
        elif step > 5:  # (the first steps warm the caches)
            healthy.append(took)
    guard.on_close()
    for line in (tmp / f"{way}{world}.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("event") == "nonfinite":
            record = rec
    named = record["ranks"] if record else None
    d = record["detail"]["per_rank"][str(world - 1)] if record else {}
    ok = named == [world - 1] and d.get("coords", {}).get("host") == f"node{(world - 1) // 8}" and \
        d.get("sample_ids") == [(world - 1) * 10, (world - 1) * 10 + 1] and d.get("first_nonfinite_module") == MODULE
    if not ok:
        raise AssertionError(f"world {world} ({way}): the non-finite rank was not named as it should be: {record}")
    return {"world": world, "way": way, "healthy_ms": statistics.median(healthy), "anomalous_ms": anomalous,
            "bytes": guard.agreement.bytes_per_step}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default="8,64,1024,16384,65536")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-check", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    worlds = [int(w) for w in args.worlds.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in worlds:
            for way in ("summary", "table"):
                if way == "summary" and world <= 64:
                    continue  # (up to 64 ranks the table is what runs)
                rows.append(run(world, way, args.steps, Path(tmp)))
    print(f"{'ranks':>7} {'way':>8} {'healthy ms':>11} {'anomalous ms':>13} {'bytes/rank/step':>16}")
    for r in rows:
        print(f"{r['world']:>7} {r['way']:>8} {r['healthy_ms']:>11.3f} {r['anomalous_ms']:>13.2f} {r['bytes']:>16,}")
    top = max(worlds)
    now = next(r for r in rows if r["world"] == top and r["way"] == ("summary" if top > 64 else "table"))
    missed = [f"{k} {now[k]:.3f} > {goal}" for k, goal in GOALS.items() if now[k] > goal]
    print(f"goals at {top:,} ranks (the way that runs there: {now['way']}): healthy <= {GOALS['healthy_ms']} ms, "
          f"<= {GOALS['bytes']} B reduced per rank, anomalous <= {GOALS['anomalous_ms']} ms: "
          + ("met" if not missed else "MISSED: " + "; ".join(missed)))
    if args.json:
        from bench._results import keep

        keep(args.json, {"goals": GOALS, "met": not missed, "rows": rows})
    return 1 if missed and not args.no_check else 0


if __name__ == "__main__":
    sys.exit(main())
