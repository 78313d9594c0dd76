"""The fire drill as a benchmark: trainguard vs plain DeepSpeed under a schedule of faults.

    python bench/fire_drill.py [--steps 1000] [--out DIR]

Same as ``trainguard drill`` (see trainguard/drill/__init__.py for the schedule and the goals).
Prints the table -- completed, final held-out loss against the fault-free run, steps lost,
goodput (productive step time / wall time), rollbacks, skipped steps -- and the goals; exit 0
when they hold. Takes ~25 ms per step per run on 2 CPU cores (three runs).
"""
from __future__ import annotations

import argparse
import sys

from trainguard.drill import drill


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--out", default="trainguard-drill")
    args = ap.parse_args(argv)
    rc, _ = drill(args.steps, args.out)
    return rc


if __name__ == "__main__":
    sys.exit(main())
