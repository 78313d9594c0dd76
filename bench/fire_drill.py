"""The fire drill as a benchmark: trainguard vs plain DeepSpeed under a schedule of faults.

    python bench/fire_drill.py [--steps 1000] [--out DIR] [--json bench/results/drill-<date>.json]

Same as ``trainguard drill`` (see trainguard/drill/__init__.py for the schedule and the goals).
Prints the table -- completed, final held-out loss against the fault-free run, steps lost,
goodput (productive step time / wall time), rollbacks, skipped steps -- and the goals; exit 0
when they hold, 1 when one is missed. ``--json`` keeps the table, the per-fault costs and the verdict
(bench/_results.keep: date, commit, clean): ``loss_vs_clean`` is trainguard's final held-out loss against the
fault-free run's. Takes ~25 ms per step per run on 2 CPU cores (four runs), more for the faults' restarts.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainguard.drill import drill  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--out", default="trainguard-drill")
    ap.add_argument("--json", help="keep the figures here (bench/_results.keep: date, commit, clean)")
    args = ap.parse_args(argv)
    rc, rows = drill(args.steps, args.out)
    if args.json:
        import platform

        import torch

        from bench._results import keep

        run = json.loads((Path(args.out) / "drill.json").read_text())
        tg = {r["run"]: r for r in rows}["trainguard"]
        keep(args.json, {"steps": args.steps, "loss_vs_clean": tg.get("loss_vs_clean"),
                         "goals_met": run["goals_met"], "machine": platform.machine(), "torch": torch.__version__,
                         "rows": rows, "costs": run["costs"]})
    return rc


if __name__ == "__main__":
    sys.exit(main())
