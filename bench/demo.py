"""The demo's printed tables, kept: what docs/demo.md shows is a run of this, not a paste (issue 55).

    python bench/demo.py [--steps 300] [--out DIR] [--json FILE]

Runs ``trainguard demo`` as a user would (its default config: the injected faults, then the natural case -- the peak
LR raised 15x at step 150 -- under trainguard and plain DeepSpeed), prints what it prints, and with ``--json`` keeps
the printed text (the run's folder written as ``trainguard-demo``) and its figures (bench/_results.keep: date,
commit, clean). Goals, judged and exit 1 on a miss: the guarded run completes with finite weights, the same on every
rank, its held-out loss within 2% of plain's where plain completes; every injected fault has a verdict; in the
natural case the guarded run completes at <= 0.8x plain's held-out loss (or plain died).
"""
from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainguard.demo.run import demo  # noqa: E402


class _Tee(io.StringIO):
    def write(self, s):
        sys.stdout.write(s)
        return super().write(s)


def goals(f: dict) -> list[tuple[str, bool, str]]:
    g, p, n = f.get("trainguard", {}), f.get("plain", {}), f.get("natural", {})
    close = g.get("eval_loss") is not None and (not p.get("completed") or bool(p.get("eval_loss"))
                                                and abs(g["eval_loss"] / p["eval_loss"] - 1) <= 0.02)
    faults = [r for r in f.get("faults", []) if r.get("fault") and not r["fault"].startswith("(")]
    unseen = [r["fault"] for r in faults if not r.get("verdict")]
    ng, np_ = n.get("trainguard", {}), n.get("plain", {})
    rescued = bool(ng.get("completed")) and ng.get("eval_loss") is not None and (
        not np_.get("completed") or np_.get("eval_loss") is not None and ng["eval_loss"] <= 0.8 * np_["eval_loss"])
    return [
        ("the guarded run completes, weights finite and the same on every rank",
         bool(g.get("completed") and g.get("weights_finite") and g.get("same_weights_on_all_ranks")),
         f"completed {g.get('completed')}, finite {g.get('weights_finite')}, "
         f"same {g.get('same_weights_on_all_ranks')}"),
        ("its held-out loss within 2% of plain DeepSpeed's (where plain completes)", close,
         f"{g.get('eval_loss')} against {p.get('eval_loss')}"),
        ("every injected fault has a verdict", bool(faults) and not unseen,
         f"{len(faults) - len(unseen)}/{len(faults)}" + (f" (none for {unseen})" if unseen else "")),
        ("natural case: guarded completes at <= 0.8x plain's held-out loss (or plain died)", rescued,
         f"{ng.get('eval_loss')} against {np_.get('eval_loss') if np_.get('completed') else 'died'}"),
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default="/tmp/trainguard-demo-bench")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    figures: dict = {}
    printed = _Tee()
    rc = demo(None, args.steps, args.out, stream=printed, figures=figures)
    judged = goals(figures) if rc == 0 else [("the demo ran", False, f"exit {rc}")]
    print()
    for name, ok, figure in judged:
        print(f"  [{'met' if ok else 'NOT met'}] {name}: {figure}")
    if args.json:
        from bench._results import keep

        text = printed.getvalue().replace(str(Path(args.out)), "trainguard-demo")
        keep(args.json, {"steps": args.steps, "printed": text, "figures": figures,
                         "goals": [{"goal": n, "met": ok, "figure": f} for n, ok, f in judged]})
    return 0 if all(ok for _, ok, _ in judged) else 1


if __name__ == "__main__":
    sys.exit(main())
