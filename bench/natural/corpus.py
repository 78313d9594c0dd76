"""A generator of natural-failure cases: family x severity x length x model size x precision x stack, drawn from a seed.

    python bench/natural/run.py --corpus held-out [--n 16] [--json FILE]

The hand-written cases of bench/natural/run.py are the set the defaults were fitted on; a default judged on them proves
nothing. Here a case is drawn from its seed: a family (a peak LR too high, a warmup too short, the LR raised mid-run,
a stretch of corrupted data, a tiny Adam epsilon, unnormalised output or attention logits), a severity (how far off,
against the healthy run's own setting), a length, a model size, a precision -- and the training seed itself -- and a
stack: DeepSpeed's own loop (the demo's worker; the default, what the kept held-out figures ran), or with
``--stacks deepspeed,hf`` HF's Trainer under ``trainguard run --`` too (bench/natural/hf_train.py, the same model, in
bf16 -- its fp16 needs a GPU --, and never the "LR raised mid-run" family: the Trainer's schedule has no such
switch, those draws stay on DeepSpeed), with ``megatron`` Megatron-LM's unmodified pretrain_gpt.py (TP=2, mock data:
bench/natural/megatron_lm.py; the families its arguments can say -- a peak LR, a warmup, Adam's epsilon, wide heads
--, the others stay on DeepSpeed; its runs carry a fourth column, Megatron-LM's own --check-for-spiky-loss). A corpus with another set of stacks is another corpus (its draws differ).
Seeds are split once: ``DEV`` seeds are what a default may be tuned on (look at them while changing a rule); the
``HELD_OUT`` seeds only report -- their table is the figure, run after the rules are set. The healthy run of a case is
the same draw with the sane setting (the demo's LR schedule, no corruption): same model, precision, seed and length.
"""
from __future__ import annotations

import random

DEV = tuple(range(1, 33))              # tune on these
HELD_OUT = tuple(range(5001, 5065))    # report on these (never looked at while a rule changed; 5033-5064 added on
#                                        2026-12-08, once 5001-5032 had all been seen)

HEALTHY_LR, HEALTHY_WARMUP = 0.003, 100
SEVERITIES = (5, 10, 20, 50)           # how many times the healthy LR (or the raise), drawn per case
LENGTHS = (300, 600)
SIZES = ((64, 2), (96, 3), (128, 4))   # (d_model, layers)
PRECISIONS = ("bf16", "bf16", "fp16")  # (bf16 first, as users run)
FAMILIES = ("lr_peak", "warmup_short", "lr_raised", "bad_data", "adam_eps", "output_logits", "attention_logits")


def draw(seed: int, stacks: tuple[str, ...] = ("deepspeed",)) -> dict:
    """One case's setting from its seed: ``{"name", "stack", "what", "bad", "sane", "steps"}`` (run.Case's fields)."""
    r = random.Random(seed)
    family, sev = r.choice(FAMILIES), r.choice(SEVERITIES)
    steps, (d_model, layers), precision, stack = r.choice(LENGTHS), r.choice(SIZES), r.choice(PRECISIONS), \
        r.choice(stacks)
    common = ["--seed", str(seed), "--d-model", str(d_model), "--layers", str(layers)]
    if stack == "hf" and family == "lr_raised" or stack == "megatron" and family not in MEGATRON_FAMILIES:
        stack = "deepspeed"  # (HF's schedule cannot be raised mid-run from its arguments; pretrain_gpt.py's arguments
        # cannot raise it either, corrupt its mock data or drop its final norm)
    if stack == "hf":
        precision = "bf16"   # (the Trainer's fp16 needs a GPU: bench/natural/hf_train.py runs bf16)
    fp16 = precision == "fp16"
    bad: dict = {"lr": HEALTHY_LR, "warmup": HEALTHY_WARMUP}
    if family == "lr_peak":
        bad["lr"], what = HEALTHY_LR * sev, f"peak LR {sev}x healthy's after {HEALTHY_WARMUP} warmup steps"
    elif family == "warmup_short":
        sev = max(2, sev // 2)
        bad.update(lr=HEALTHY_LR * sev, warmup=1)
        what = f"peak LR {sev}x healthy's reached in 1 step"
    elif family == "lr_raised":
        at = r.randrange(steps // 3, steps // 2)
        common += ["--raise-lr", f"{at}:{sev}"]
        what = f"the peak LR raised {sev}x at step {at} (a resume with another schedule)"
    elif family == "bad_data":
        start = r.randrange(steps // 3, steps // 2)
        span, kind = r.choice((20, 50, 80)), r.choice(("random", "repeat"))
        common += ["--bad-data", f"{start}:{start + span}:{kind}"]
        what = f"steps {start}-{start + span} read corrupted batches ({kind})"
    elif family == "adam_eps":
        sev = max(2, sev // 5)
        bad["lr"] = HEALTHY_LR * sev
        common += ["--adam-eps", "1e-16", "--adam-beta2", "0.99999"]
        what = f"Adam epsilon 1e-16, beta2 0.99999, peak LR {bad['lr'] / HEALTHY_LR:g}x healthy's"
    elif family == "output_logits":
        bad["lr"] = HEALTHY_LR * sev
        common += ["--no-final-norm"]
        what = f"no final LayerNorm before the output head, peak LR {sev}x healthy's"
    else:
        bad["lr"] = HEALTHY_LR * sev
        common += ["--heads", "1"]
        what = f"one wide attention head, peak LR {sev}x healthy's"
    sane_args = ["--seed", str(seed), "--d-model", str(d_model), "--layers", str(layers)]
    if family == "attention_logits":
        sane_args += ["--heads", "1"]
    if family == "output_logits":
        sane_args += ["--no-final-norm"]
    if family == "adam_eps":
        sane_args += ["--adam-eps", "1e-16", "--adam-beta2", "0.99999"]
    if stack == "megatron":  # (Megatron-LM's own names for the same settings; TP=2: heads split over 2 ranks)
        bad, sane_args = _megatron(bad, common, sane_args, fp16)
        common = bad.pop("args")
        if family == "attention_logits":
            what = "two wide attention heads (one a TP rank)" + what[len("one wide attention head"):]
    name = f"s{seed}_{family}_x{sev}_{precision}_{d_model}x{layers}_{steps}" + \
        {"hf": "_hf", "megatron": "_mg"}.get(stack, "")
    return {"name": name, "stack": stack, "what": f"{what}; d_model {d_model}, {layers} layers, {precision}, "
            f"{steps} steps, seed {seed}" + {"hf": " (HF Trainer)", "megatron": " (Megatron-LM pretrain_gpt.py, "
                                              "TP=2)"}.get(stack, ""),
            "bad": {**bad, "fp16": fp16, "args": common},
            "sane": {"lr": HEALTHY_LR, "warmup": HEALTHY_WARMUP, "fp16": fp16, "args": sane_args}, "steps": steps}


MEGATRON_FAMILIES = ("lr_peak", "warmup_short", "adam_eps", "attention_logits")
_MEGATRON_NAMES = {"--d-model": "--hidden-size", "--layers": "--num-layers", "--heads": "--num-attention-heads"}


def _megatron(bad: dict, common: list, sane_args: list, fp16: bool) -> tuple[dict, list]:
    """A draw's arguments in pretrain_gpt.py's names (bench/natural/megatron_lm.py's tiny GPT, overridden): its
    precision a flag, one wide head two (TP=2 splits the heads)."""
    def named(args):
        out = [_MEGATRON_NAMES.get(a, a) for a in args]
        out = [("2" if i and out[i - 1] == "--num-attention-heads" else a) for i, a in enumerate(out)]
        return out + ["--fp16" if fp16 else "--bf16"]
    return {**bad, "args": named(common)}, named(sane_args)


def cases(which: str, n: int | None = None, stacks: tuple[str, ...] = ("deepspeed",)) -> list[dict]:
    """The first ``n`` draws of the ``dev`` or ``held-out`` seeds."""
    seeds = {"dev": DEV, "held-out": HELD_OUT}[which]
    return [draw(s, stacks) for s in seeds[:n]]
