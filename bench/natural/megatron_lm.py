"""The natural-failure corpus's Megatron-LM stack: Megatron-LM's unmodified ``pretrain_gpt.py`` (core_v0.19.0, from
../shared/third_party, as a user's checkout) on the installed megatron-core, a tiny GPT on mock data at TP=2 on 2
CPU ranks, launched as the README says -- ``trainguard run -- torchrun ... pretrain_gpt.py <its arguments>
--trainguard-config tg.json`` -- or plainly (no prefix, no argument).

Megatron-LM has no held-out loss here (``--eval-iters 0``): a run's outcome is its final training loss (the
median of its last 10 iterations' ``lm loss``, from Megatron-LM's own log lines).

CPU only through the test-only layer (tests/support/megatron_lm_site, as the suite's Megatron-LM tests use it).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import uuid
from pathlib import Path

from trainguard.demo.run import run_bounded
from trainguard.metrics.jsonl import read

ROOT = Path(__file__).resolve().parents[2]
CHECKOUT = ROOT.parent / "shared" / "third_party" / "megatron-lm-core_v0.19.0"
TINY = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
        "--micro-batch-size 4 --global-batch-size 8 --lr-decay-style constant "
        "--mock-data --tokenizer-type NullTokenizer --vocab-size 128 --seed 1234 "
        "--transformer-impl local --no-persist-layer-norm --no-gradient-accumulation-fusion "
        "--no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion --no-rope-fusion "
        "--distributed-backend gloo --eval-iters 0 --eval-interval 100000 --log-interval 1 "
        "--ckpt-format torch_dist --tensor-model-parallel-size 2 --clip-grad 1.0").split()
SPIKY = re.compile(r"iteration #?(\d+)\D.*message='Spiky loss'")
LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?learning rate: ([-+.0-9E]+) \|(?:.*?lm loss: ([-+.0-9E]+) \|)?")


def available() -> str | None:
    """Why the Megatron-LM stack cannot run here (None: it can)."""
    if not (CHECKOUT / "pretrain_gpt.py").is_file():
        return f"no Megatron-LM checkout at {CHECKOUT}"
    import importlib.util

    # (found, not imported: megatron.training needs the test-only layer the ranks get, tests/support/megatron_lm_site)
    # (find_spec of a submodule imports its parent: without any megatron it raises instead of returning None)
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None \
            or importlib.util.find_spec("megatron.training") is None:
        return "megatron-core with megatron.training is not installed (scripts/setup.sh test installs it)"
    return None


def run(setting: dict, which: str, out: Path, steps: int, block: dict) -> dict:
    """One run: ``setting`` {"lr", "warmup", "args"}; ``which`` healthy / plain / guarded, or peer (plain, with
    Megatron-LM's own switches in ``setting``). Returns the bench's run summary (run.py's ``summarise_run`` shape)."""
    import time

    out = Path(out).resolve()  # (pretrain_gpt.py runs in this folder: a relative --out would name files it cannot find)
    out.mkdir(parents=True, exist_ok=True)
    args = [*TINY, "--lr", str(setting.get("lr", 1e-3)), "--lr-warmup-iters", str(setting.get("warmup", 30)),
            "--train-iters", str(steps), *setting.get("args", [])]
    unguarded = which in ("plain", "peer")
    if not unguarded:
        block = {**block, "metrics": {**block.get("metrics", {}), "jsonl": str(out / "trainguard.jsonl")},
                 "checkpoint": {**block.get("checkpoint", {}), "dir": str(out / "ckpt")}}
        (out / "tg.json").write_text(json.dumps({"trainguard": block}))
        args += ["--trainguard-config", str(out / "tg.json")]
    bin_ = Path(sys.executable).parent
    prefix = [] if unguarded else [str(bin_ / "trainguard"), "run", "--"]
    command = [*prefix, str(bin_ / "torchrun"), "--standalone", "--nproc-per-node", "2",
               str(CHECKOUT / "pretrain_gpt.py"), *args]
    marker = f"{out}:{uuid.uuid4().hex}"
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1", TRAINGUARD_TEST_ROOT=str(ROOT),
               # (this checkout's trainguard, also where another is installed: the bench measures the code beside it)
               PYTHONPATH=os.pathsep.join([str(ROOT / "tests" / "support" / "megatron_lm_site"), str(CHECKOUT),
                                           str(ROOT)]),
               TRAINGUARD_TEST_RUN=marker)
    t0 = time.time()
    with open(out / "megatron.log", "w") as log:
        rc, _, _ = run_bounded(command, 1200, cwd=out, env=env, stdout=log, stderr=subprocess.STDOUT)
    shutil.rmtree(out / "ckpt", ignore_errors=True)
    return summarise(out, rc, time.time() - t0)


def summarise(out: Path, rc: int, seconds: float) -> dict:
    """What a run left in ``out`` (Megatron-LM's log, trainguard's JSONL), in the bench's run summary shape."""
    text = (out / "megatron.log").read_text(errors="replace")
    losses: dict[int, float] = {}
    for m in LINE.finditer(text):
        if m[3] is not None:
            losses[int(m[1])] = float(m[3])
    series = [losses[i] for i in sorted(losses)]
    events = [e for e in read(out / "trainguard.jsonl") if e.get("type") == "event"] \
        if (out / "trainguard.jsonl").exists() else []
    aborted = next((e["detail"].get("reason") for e in events if e["event"] == "abort"), None)
    died = None if rc == 0 or aborted else (_last_error(text) or f"exit {rc}")
    end = next((e["detail"] for e in events if e["event"] == "run_end"), {})
    final = statistics.median(series[-10:]) if len(series) >= 10 else None
    return {"rc": rc, "died": died, "aborted": aborted, "eval": final, "losses": series,
            # (Megatron-LM's own check, where it was on: each loss its --check-for-spiky-loss rejected, on any rank)
            "peer_fired": len({m for m in SPIKY.findall(text)}),
            "steps": max(losses, default=0), "seconds": round(seconds, 1), "events": events,
            "lost": (end.get("goodput") or {}).get("steps_lost")}


def _last_error(text: str) -> str | None:
    lines = [x for x in text.splitlines() if "Error" in x or "Exception" in x]
    return lines[-1].strip()[:200] if lines else None
