"""A corpus of natural failures: settings that really fail, nothing injected, each run three ways.

    python bench/natural/run.py [--cases NAME,...] [--stack deepspeed|hf|megatron] [--out DIR] [--json FILE]
    python bench/natural/run.py --corpus held-out [--n 16] [--stacks deepspeed,hf,megatron] [--json FILE]

Every case is a small model that fails when run plainly -- an LR peak too high, a warmup too short, fp16 whose
loss scale collapses, a schedule raised mid-run, a stretch of corrupted data, Adam's epsilon too small,
unnormalised output logits -- run

- *healthy*: the same run with a sane setting, under trainguard (the README's block, default detectors): what
  the run should reach, and what trainguard must leave alone (no action, at most one alert incident per 1,000
  steps);
- *plain*: the failing setting without trainguard;
- *guarded*: the failing setting under trainguard (the same block);
- *peer*, where a stack has a switch of its own for what trainguard guards (``PEERS``: Megatron-LM's
  ``--check-for-spiky-loss``): the failing setting without trainguard, the switch on -- a second table says where
  the framework's own switch gets, beside plain and trainguard. (DeepSpeed's own handling -- fp16's dynamic loss
  scale, its gradient clipping -- is on in every plain run.)

One table: the plain outcome (its held-out loss against healthy's, or how it died), what the guarded run did and
when, the steps it lost, its held-out loss against healthy's, and the detection delay: the first action's step
minus the step where the plain run's loss left its band (its 8-step median more than 10% above the best it had
reached, or non-finite; none when it never climbed). The goals of issue 33 are checked at the end (exit 1 when one
is missed; ``--json`` keeps the rows and goals with the date, commit and a clean-tree flag). No fault injection anywhere:
``trainguard.faults`` is not configured in any run.

The DeepSpeed cases run the demo's model (trainguard/demo) under DeepSpeed's own loop; the HF cases the same model
through Hugging Face's Trainer under ``trainguard run -- torchrun`` (bench/natural/hf_train.py: the script knows
nothing of trainguard); the Megatron-LM cases its unmodified pretrain_gpt.py, a tiny GPT on mock data at TP=2
(bench/natural/megatron_lm.py; their outcome is the final training loss, Megatron-LM evaluating nothing here).
"""
from __future__ import annotations

import argparse
import copy
import os
import json
import math
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from trainguard.demo.run import run_worker  # noqa: E402
from trainguard.metrics.jsonl import read  # noqa: E402

BLOCK = {  # the README's block: checkpoints, the event log; default detectors and ladders
    "enabled": True,
    "checkpoint": {"every_steps": 50, "stable_after": 20, "keep_last": 3},
    "metrics": {"jsonl": "trainguard.jsonl"},
}
BASE = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 2},
    "bf16": {"enabled": True},
    "steps_per_print": 1000000,
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.003,
                                                 "warmup_num_steps": 100}},
}
FP16 = {"enabled": True, "initial_scale_power": 16, "min_loss_scale": 1}
HF_BASE = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "gradient_clipping": "auto", "zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"},
           "steps_per_print": 1000000}
PREFIX = [sys.executable, "-m", "trainguard.cli", "run", "--"]
ACTIONS = ("skip_step", "rollback", "rollback_lower_lr", "bf16_fallback", "abort")
# records of what the framework did itself, not trainguard: an fp16 scaler's routine overflow (DeepSpeed skipped the
# step and halved the scale; trainguard only says so) -- never counted as trainguard's action
ROUTINE = ("overflow", "framework_skip")


def acted_on(events: list) -> list:
    """trainguard's own actions among a run's records."""
    return [e for e in events if e.get("action") in ACTIONS and e["event"] not in ROUTINE]


@dataclass
class Case:
    name: str
    stack: str
    what: str
    bad: dict                      # {"lr": .., "warmup": .., "fp16": bool, "args": [...]}
    sane: dict = field(default_factory=dict)   # what healthy changes (default: LR 0.003 after 100 warmup steps)
    steps: int = 300

    def setting(self, which: str) -> dict:
        """The failing setting, or for *healthy* the sane one: the demo's LR schedule unless ``sane`` says; for
        *peer* the failing one with the framework's own switches on (PEERS)."""
        if which == "peer":
            return {**self.bad, "args": [*self.bad.get("args", []), *PEERS[self.stack]]}
        return {**self.bad, "lr": 0.003, "warmup": 100, **self.sane} if which == "healthy" else self.bad

    def config(self, which: str, out: Path) -> dict:
        s = self.setting(which)
        if self.stack == "hf":  # (the Trainer fills the "auto"s from its arguments; LR and warmup are its own)
            cfg = copy.deepcopy(HF_BASE)
            if which not in UNGUARDED:  # (the Trainer's working directory is not the run's: paths absolute)
                cfg["trainguard"] = copy.deepcopy(BLOCK)
                cfg["trainguard"]["metrics"]["jsonl"] = str(out / "trainguard.jsonl")
                cfg["trainguard"]["checkpoint"]["dir"] = str(out / "ckpt")
            return cfg
        cfg = copy.deepcopy(BASE)
        cfg["scheduler"]["params"].update({"warmup_max_lr": s.get("lr", 0.003),
                                           "warmup_num_steps": s.get("warmup", 100)})
        if s.get("fp16"):
            cfg.pop("bf16")
            cfg["fp16"] = dict(FP16)
        if which not in UNGUARDED:
            cfg["trainguard"] = copy.deepcopy(BLOCK)
        return cfg

    def args(self, which: str) -> list[str]:
        s = self.setting(which)
        lr = ["--lr", str(s.get("lr", 0.003)), "--warmup", str(s.get("warmup", 100))] if self.stack == "hf" else []
        return lr + list(s.get("args", []))

    def launch(self, which: str) -> dict:
        """run_worker's module and prefix: DeepSpeed's own loop (the demo worker), or HF's Trainer under
        ``trainguard run --`` (plain: no prefix, no block)."""
        if self.stack == "hf":
            return {"module": "bench.natural.hf_train", "prefix": () if which in UNGUARDED else PREFIX}
        return {}


# The frameworks' own switches for what trainguard guards, run as a fourth column (*peer*: the failing setting, no
# trainguard, the switch on) where a stack has one a user can turn on: Megatron-LM's --check-for-spiky-loss (a loss
# 10x the largest seen is re-run; one that reproduces is logged and the run goes on). megatron-core's
# OptimizerConfig.grad_norm_skip_threshold has no pretrain_gpt.py argument in core_v0.19.0. DeepSpeed's own handling
# (fp16's dynamic loss scale skipping an overflowing step, the configured gradient clipping) is on in every plain run:
# its column is *plain*. HF's Trainer adds none.
PEERS = {"megatron": ["--check-for-spiky-loss"]}
UNGUARDED = ("plain", "peer")

CASES = [
    Case("lr_peak_early", "deepspeed", "warmup to a peak LR 17x too high (0.05)", {"lr": 0.05}),
    Case("warmup_too_short", "deepspeed", "peak 0.03 reached in 1 step (no warmup)", {"lr": 0.03, "warmup": 1}),
    Case("fp16_scale_collapse", "deepspeed", "fp16 (min scale 1) at a peak LR of 0.1: the scale collapses",
         {"lr": 0.1, "fp16": True}, {"lr": 0.003}),
    Case("lr_raised_midrun", "deepspeed", "a run resumed at step 150 with its peak LR raised 15x",
         {"args": ["--raise-lr", "150:15"]}, {"args": []}),
    Case("bad_data_stretch", "deepspeed", "steps 150-200 read a shard of another tokenizer (uniform ids)",
         {"args": ["--bad-data", "150:200:random"]}, {"args": []}),
    Case("repeated_tokens", "deepspeed", "steps 150-200 read one token repeated (a broken packer)",
         {"args": ["--bad-data", "150:200:repeat"]}, {"args": []}),
    Case("adam_eps_tiny", "deepspeed", "Adam epsilon 1e-16 and beta2 0.99999 at peak LR 0.01",
         {"lr": 0.01, "args": ["--adam-eps", "1e-16", "--adam-beta2", "0.99999"]},
         {"lr": 0.01, "args": []}),
    Case("output_logits", "deepspeed", "no final LayerNorm before the output head, peak LR 0.03",
         {"lr": 0.03, "args": ["--no-final-norm"]}, {"lr": 0.003}),
    Case("attention_logits", "deepspeed", "one wide head (d_head 96), no QK normalisation, peak LR 0.03",
         {"lr": 0.03, "args": ["--heads", "1"]}, {"lr": 0.003}),
    # 2,000 steps: a cut's 1,000-step cooldown expires and the schedule's LR comes back (issue 51)
    Case("lr_raised_long", "deepspeed", "resumed at step 300 with its peak LR raised 10x; 2,000 steps: a cut's "
         "cooldown (1,000) expires", {"args": ["--raise-lr", "300:10"]}, {"args": []}, steps=2000),
    Case("lr_peak_long", "deepspeed", "warmup to a peak LR 10x too high (0.03); 2,000 steps: a cut's cooldown "
         "(1,000) expires", {"lr": 0.03}, steps=2000),
    Case("hf_lr_peak_early", "hf", "HF Trainer: learning_rate 0.2 after 100 warmup steps", {"lr": 0.2}),
    Case("hf_warmup_too_short", "hf", "HF Trainer: learning_rate 0.03, warmup_steps 1", {"lr": 0.03, "warmup": 1}),
    Case("hf_bad_data_stretch", "hf", "HF Trainer: steps 150-200 read a shard of another tokenizer",
         {"args": ["--bad-data", "150:200:random"]}, {"args": []}),
    # Megatron-LM's pretrain_gpt.py (healthy: --lr 1e-3 after 30 warmup iterations)
    Case("mg_lr_peak_early", "megatron", "pretrain_gpt.py: --lr 0.3 after 30 warmup iterations",
         {"lr": 0.3, "warmup": 30}, {"lr": 1e-3, "warmup": 30}, steps=150),
    Case("mg_warmup_too_short", "megatron", "pretrain_gpt.py: --lr 0.15, --lr-warmup-iters 1",
         {"lr": 0.15, "warmup": 1}, {"lr": 1e-3, "warmup": 30}, steps=150),
]


def run_case(case: Case, out: Path, reuse: bool = False, rerun: tuple[str, ...] = ()) -> dict:
    runs = {}
    for which in ("healthy", "plain", "guarded") + (("peer",) if case.stack in PEERS else ()):
        d = out / case.name / which
        if reuse and which not in rerun and (d / "summary.json").exists():  # (judged again from what a run left, not run again)
            runs[which] = json.loads((d / "summary.json").read_text())
            continue
        if d.exists():  # (a run again starts afresh: it would resume from the last one's checkpoints)
            shutil.rmtree(d)
        d.mkdir(parents=True)
        cfg_path = d / "ds_config.json"
        cfg_path.write_text(json.dumps(case.config(which, d), indent=1))
        extra = case.args(which) + (["--plain"] if which in UNGUARDED else [])
        if case.stack == "megatron":
            from bench.natural import megatron_lm as megatron

            runs[which] = megatron.run(case.setting(which), which, d, case.steps, BLOCK)
        else:
            t0 = time.time()
            rc, results = run_worker(cfg_path, d, case.steps, extra=extra, timeout=900, **case.launch(which))
            runs[which] = summarise_run(d, rc, results, time.time() - t0)
        (d / "summary.json").write_text(json.dumps(runs[which], default=str))
    return judge(case, runs)


def summarise_run(d: Path, rc: int, results: list, seconds: float) -> dict:
    r0 = results[0] or {}
    died = next((r.get("died") for r in results if r and r.get("died")), None)
    aborted = next((r.get("aborted") for r in results if r and r.get("aborted")), None)
    if rc != 0 and not died and not aborted:
        died = f"exit {rc} (see {d / 'torchrun.log'})"
    events = [e for e in read(d / "trainguard.jsonl") if e.get("type") == "event"] \
        if (d / "trainguard.jsonl").exists() else []
    end = next((e["detail"] for e in events if e["event"] == "run_end"), {})
    return {"rc": rc, "died": died, "aborted": (aborted or {}).get("message"), "eval": r0.get("eval_loss"),
            "losses": r0.get("losses", []), "steps": r0.get("global_steps"), "seconds": round(seconds, 1),
            "events": events, "lost": (end.get("goodput") or {}).get("steps_lost")}


def smooth(xs: list, k: int = 8) -> list:
    return [statistics.median(xs[max(0, i - k + 1):i + 1]) if all(map(math.isfinite, xs[max(0, i - k + 1):i + 1]))
            else math.inf for i in range(len(xs))]


def left_band(plain: list, tol: float = 0.15) -> int | None:
    """The first step where the plain run's loss left its band: its smoothed loss (8-step median) more than ``tol``
    above the best level it had reached (the lowest 32-step median: the lowest 8-step median of a noisy loss lies
    below its level, and noise alone would leave a band over it), or not finite, after the first 20 steps. None: it
    never climbed (a run that only converges slower has no such step)."""
    xs = [x if x is not None else math.inf for x in plain]
    p, level = smooth(xs), smooth(xs, 32)
    best = math.inf
    for i, x in enumerate(p):
        if i >= 20 and (not math.isfinite(x) or x > best * (1 + tol)):
            return i + 1
        if i >= 31:
            best = min(best, level[i])
    return None


def incidents(events: list) -> int:
    """Alert incidents opened (records written as alerts)."""
    return sum(1 for e in events if e.get("action") == "alert")


def judge(case: Case, runs: dict) -> dict:
    healthy, plain, guarded = runs["healthy"], runs["plain"], runs["guarded"]
    h_eval = healthy["eval"]
    acted = [e for e in acted_on(guarded["events"]) if e["event"] != "rollback"]
    first = acted[0] if acted else None
    band = left_band(plain["losses"])
    rel = lambda x: None if x is None or not h_eval else x / h_eval - 1  # noqa: E731
    plain_bad = plain["died"] is not None or plain["eval"] is None or rel(plain["eval"]) >= 0.20
    guarded_rel = rel(guarded["eval"])
    # against plain too (the table is two-sided): the share of plain's gap to healthy the guarded run closed
    gap = None
    if guarded["eval"] is not None and h_eval:
        if plain["eval"] is not None and not plain["died"] and plain["eval"] > h_eval:
            gap = (plain["eval"] - guarded["eval"]) / (plain["eval"] - h_eval)
        elif plain["died"] or plain["eval"] is None:
            gap = 1.0 if abs(guarded_rel) <= 0.10 else 0.0  # (plain died: closed when guarded reached healthy)
    return {
        "case": case.name, "stack": case.stack, "what": case.what,
        "healthy_eval": h_eval, "healthy_actions": [e["event"] for e in acted_on(healthy["events"])],
        "healthy_incidents_per_1k": round(1000 * incidents(healthy["events"]) / max(healthy["steps"] or 1, 1), 2),
        "plain": "died at step %s: %s" % (plain["steps"], (plain["died"] or "")[:60]) if plain["died"]
        else f"{plain['eval']:.3f} ({rel(plain['eval']):+.0%})" if plain["eval"] is not None else "NaN",
        "plain_bad": plain_bad,
        **_peer(runs.get("peer"), rel, h_eval),
        "guarded_did": [f"{e['event']}@{e['step']}:{e['action']}" for e in acted][:6],
        "guarded_aborted": guarded["aborted"],
        "guarded_eval": guarded["eval"], "guarded_rel": guarded_rel, "steps_lost": guarded["lost"],
        "gap_closed": None if gap is None else round(gap, 3),
        "ended_by_trainguard": bool(guarded["aborted"]) and not plain["died"] and plain["eval"] is not None,
        "left_band": band, "first_action": first["step"] if first else None,
        "delay": (first["step"] - band) if first and band else None,
        "seconds": {k: v["seconds"] for k, v in runs.items()},
    }


def _peer(peer: dict | None, rel, h_eval) -> dict:
    """The framework's own switches' column (PEERS): its outcome against healthy and how many iterations its check
    fired on."""
    if peer is None:
        return {}
    said = "died at step %s: %s" % (peer["steps"], (peer["died"] or "")[:60]) if peer["died"] else \
        "NaN" if peer["eval"] is None else f"{peer['eval']:.3f}" + (f" ({rel(peer['eval']):+.0%})" if h_eval else "")
    return {"peer": said, "peer_eval": peer["eval"], "peer_rel": None if peer["died"] else rel(peer["eval"]),
            "peer_fired": peer.get("peer_fired")}


def table(rows: list[dict]) -> str:
    head = (f"{'case':<20.20} {'stack':<9} {'plain vs healthy':<34} {'guarded did (first)':<36} "
            f"{'lost':>5} {'guarded':>9} {'gap':>5} {'band':>5} {'delay':>6}")
    out = [head, "-" * len(head)]
    for r in rows:
        did = r["guarded_did"][0] if r["guarded_did"] else "nothing"
        if r["guarded_aborted"]:
            did = "ABORT: " + r["guarded_aborted"][:28]
        g = "died" if r["guarded_eval"] is None else f"{r['guarded_rel']:+.1%}"
        gap = "-" if r.get("gap_closed") is None else f"{r['gap_closed']:.0%}"
        out.append(f"{r['case']:<20.20} {r['stack']:<9} {r['plain']:<34.34} {did:<36.36} {str(r['steps_lost']):>5} "
                   f"{g:>9} {gap:>5} {str(r['left_band']):>5} {str(r['delay']):>6}")
    peers = [r for r in rows if "peer" in r]
    if peers:  # (the frameworks' own switches beside plain and trainguard: PEERS)
        out += ["", "the frameworks' own switches (" + "; ".join(f"{k}: {' '.join(v)}" for k, v in PEERS.items()) + ")",
                f"{'case':<20.20} {'plain vs healthy':<34} {'switch on vs healthy':<34} {'fired':>5} {'guarded':>9}"]
        for r in peers:
            g = "died" if r["guarded_eval"] is None else "-" if r["guarded_rel"] is None else f"{r['guarded_rel']:+.1%}"
            out.append(f"{r['case']:<20.20} {r['plain']:<34.34} {r['peer']:<34.34} {str(r['peer_fired']):>5} {g:>9}")
    return "\n".join(out)


def goals(rows: list[dict]) -> list[tuple[str, bool, str]]:
    bad = [r for r in rows if r["plain_bad"]]
    acted = [r for r in bad if r["guarded_did"]]
    near = [r for r in rows if r["guarded_rel"] is not None and r["guarded_rel"] <= 0.05]
    timed = [r for r in bad if r["delay"] is not None]
    prompt = [r for r in timed if r["delay"] <= 10]
    quiet = [r for r in rows if not r["healthy_actions"] and r["healthy_incidents_per_1k"] <= 1.0]
    return [
        ("every case the plain run fails is acted on", len(acted) == len(bad), f"{len(acted)}/{len(bad)}"),
        ("guarded within 5% of healthy in >= 80% of cases", len(near) >= 0.8 * len(rows), f"{len(near)}/{len(rows)}"),
        ("detection within 10 steps of leaving the band", len(prompt) == len(timed), f"{len(prompt)}/{len(timed)}"),
        ("healthy runs: no action, <= 1 alert incident per 1,000 steps", len(quiet) == len(rows),
         f"{len(quiet)}/{len(rows)}"),
    ]


def corpus_goals(rows: list[dict]) -> list[tuple[str, bool, str]]:
    """Issue 51's goals, for a generated corpus (judged on held-out seeds): every failing case acted on; guarded
    within 10% of healthy either way, or >= 90% of plain's gap to healthy closed, in >= 85%; no action on a healthy
    run; no run ended by trainguard that the framework finished."""
    bad = [r for r in rows if r["plain_bad"]]
    acted = [r for r in bad if r["guarded_did"]]
    good = [r for r in rows if r["guarded_rel"] is not None and (abs(r["guarded_rel"]) <= 0.10 or (
        r["plain_bad"] and (r.get("gap_closed") or 0) >= 0.9))]
    false = [r for r in rows if r["healthy_actions"]]
    ended = [r for r in rows if r.get("ended_by_trainguard")]
    return [
        ("every case the plain run fails is acted on", len(acted) == len(bad), f"{len(acted)}/{len(bad)}"),
        ("guarded within 10% of healthy, or >= 90% of the gap from plain closed, in >= 85% of cases",
         len(good) >= 0.85 * len(rows), f"{len(good)}/{len(rows)}"),
        ("no action on a healthy run", not false, f"{len(false)} with actions: {[r['case'] for r in false][:4]}"),
        ("no run ended by trainguard that the framework finished", not ended,
         f"{len(ended)}: {[r['case'] for r in ended][:4]}"),
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", help="comma-separated case names (default: all)")
    ap.add_argument("--stack", choices=["deepspeed", "hf", "megatron"])
    ap.add_argument("--out", default="/tmp/trainguard-natural")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--reuse", action="store_true", help="judge the runs already in --out again (no run)")
    ap.add_argument("--rerun", default="", help="with --reuse: run these again (healthy,guarded: a rule changed -- "
                    "plain DeepSpeed's runs do not depend on trainguard's)")
    ap.add_argument("--steps", type=int, help="every case this many steps (a quick look; the goals need the cases' own)")
    ap.add_argument("--corpus", choices=["dev", "held-out"], help="generated cases (bench/natural/corpus.py) instead "
                    "of the hand-written ones: dev seeds to tune on, held-out seeds to report on")
    ap.add_argument("--n", type=int, help="with --corpus: the first N seeds' cases (default: all)")
    ap.add_argument("--stacks", default="deepspeed", help="with --corpus: the stacks a case may be drawn on "
                    "(deepspeed,hf)")
    args = ap.parse_args(argv)
    os.chdir(ROOT)  # (the HF stack's workers run ``-m bench.natural.hf_train``)
    pool = CASES
    if args.corpus:
        from bench.natural.corpus import cases as generated

        pool = [Case(**c) for c in generated(args.corpus, args.n, tuple(args.stacks.split(",")))]
    chosen = [c for c in pool if (not args.cases or c.name in args.cases.split(","))
              and (not args.stack or c.stack == args.stack)]
    from bench.natural import megatron_lm as megatron

    why = megatron.available()
    left_out = [c.name for c in chosen if why and c.stack == "megatron"]
    if left_out:  # (said, kept in the JSON, and the bench exits 1: a figure without its cases is not the figure)
        print(f"  (the Megatron-LM cases are left out: {why}: {', '.join(left_out)})")
        chosen = [c for c in chosen if c.stack != "megatron"]
    rows = []
    for c in chosen:
        c.steps = args.steps or c.steps
        print(f"  {c.name} ({c.stack}): {c.what} ...", flush=True)
        rows.append(run_case(c, Path(args.out), args.reuse, tuple(filter(None, args.rerun.split(",")))))
    print()
    print(table(rows))
    print()
    judged = corpus_goals(rows) if args.corpus else goals(rows)
    for name, ok, figure in judged:
        print(f"  [{'met' if ok else 'NOT met'}] {name}: {figure}")
    if args.json:  # (kept with its date, commit and whether the tree was clean: bench/_results.keep)
        from bench._results import keep

        keep(args.json, {"steps_override": args.steps, "corpus": args.corpus, "goals": [{"goal": n, "met": ok, "figure": f}
                                                                   for n, ok, f in judged],
                         "left_out": [{"case": n, "why": why} for n in left_out],
                         "rows": json.loads(json.dumps(rows, default=str))})
    if left_out:
        print(f"  [NOT met] every case chosen ran: {len(left_out)} Megatron-LM case(s) left out ({why})")
    return 0 if all(ok for _, ok, _ in judged) and not left_out else 1


if __name__ == "__main__":
    sys.exit(main())
