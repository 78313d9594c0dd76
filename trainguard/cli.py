"""The ``trainguard`` command.

    trainguard validate FILE [--under ADAPTER]
                                   check a ds_config's "trainguard" block (exit 0 ok, 2 invalid or refused
                                   under ADAPTER; each adapter's refusals listed)
    trainguard demo [--config FILE] [--steps N] [--out DIR]
                                   2-rank torchrun demo: faults, verdicts, actions, and the same run
                                   under plain DeepSpeed beside it
    trainguard drill [--steps N] [--out DIR]
                                   fire drill: a schedule of faults (NaN, poisoned batches, corrupt
                                   checkpoint, LR ramp, fp16 scale collapse) under trainguard and
                                   under plain DeepSpeed, against a clean run; exit 0 when the goals hold
    trainguard ckpt list DIR | verify DIR [TAG] [--key-env NAME] | inspect DIR TAG
                    | sign DIR [TAG] --key-env NAME [--old-key-env OLD]
                                   committed checkpoints: step, stable, size, checksums, lineage
    trainguard run -- COMMAND [ARGS...]
                                   run your launch command (torchrun, deepspeed, accelerate launch,
                                   python) with the zero-code entry: every deepspeed.initialize of the
                                   job whose config has an enabled block gets the full guard
    trainguard versions [--constraints]
                                   the support matrix beside what is installed here (exit 1: outside it)
    trainguard report LOG [--out DIR]
                                   PNG plots from a JSONL log (loss and events, gradient norm,
                                   loss scale and skipped steps, attention-entropy heatmap)
"""
from __future__ import annotations

import argparse
import json
import sys

from trainguard import __version__
from trainguard.errors import ConfigError


def _validate(args) -> int:
    from trainguard.support.validate import validate

    return validate(args.file, args.under)


def _demo(args) -> int:
    from trainguard.demo.run import demo

    extra = []
    if args.zero_stage is not None:
        extra += ["--zero-stage", str(args.zero_stage)]
    if args.dtype:
        extra += ["--dtype", args.dtype]
    return demo(args.config, args.steps, args.out, extra=extra, natural=not args.no_natural)


def _drill(args) -> int:
    from trainguard.drill import drill

    rc, _ = drill(args.steps, args.out)
    return rc


def _report(args) -> int:
    from trainguard.metrics.jsonl import read
    from trainguard.observe.report import render
    from trainguard.observe.summary import summarize

    import re
    from pathlib import Path

    own = re.fullmatch(r"(.+)\.rank(\d+)(\.\w+)", Path(args.log).name)
    if own:  # (metrics.per_rank: one rank's own lines -- no run_start, no run_end; the run's story is the run's log)
        whole = Path(args.log).with_name(own.group(1) + own.group(3))
        print(f"trainguard report: {args.log} is rank {own.group(2)}'s own log (metrics.per_rank), not the run's: "
              f"`trainguard report {whole}`", file=sys.stderr)
        return 2
    try:
        text = summarize(read(args.log))
        print(text)  # (the answer first: then the plots)
        try:
            files = render(args.log, args.out)
        except ImportError as e:  # (the pictures need the [monitor] extra; the summary does not)
            files = []
            print(f"trainguard report: no pictures -- {e.name or 'matplotlib'} is not installed "
                  "(pip install matplotlib, or trainguard's [monitor] extra, draws them)", file=sys.stderr)
        Path(args.out).mkdir(parents=True, exist_ok=True)
    except (OSError, ValueError) as e:
        print(f"trainguard report: {e}", file=sys.stderr)
        return 2
    (Path(args.out) / "summary.txt").write_text(text + "\n")
    for f in [*files, Path(args.out) / "summary.txt"]:
        print(f)
    return 0


def _ckpt(args) -> int:
    from trainguard.checkpoint import cli as ck
    from trainguard.checkpoint.layout import CheckpointError

    try:
        if args.ckpt_command == "list":
            return ck.ckpt_list(args.dir, checksums=not args.fast)
        if args.ckpt_command in ("verify", "sign"):
            key = None
            if args.key_env:
                from trainguard.checkpoint.auth import key_in

                key = key_in(args.key_env)
                if key is None:
                    print(f"trainguard ckpt {args.ckpt_command}: the environment variable {args.key_env} is not set",
                          file=sys.stderr)
                    return 2
                if args.ckpt_command == "sign":
                    from trainguard.checkpoint.auth import weak

                    if weak(key):
                        print(f"trainguard ckpt sign: {weak(key, args.key_env)}", file=sys.stderr)
                        return 2
            if args.ckpt_command == "sign":
                old = key_in(args.old_key_env) if args.old_key_env else None
                if args.old_key_env and old is None:
                    print(f"trainguard ckpt sign: the environment variable {args.old_key_env} is not set",
                          file=sys.stderr)
                    return 2
                return ck.ckpt_sign(args.dir, key, args.tag, old_key=old)
            return ck.ckpt_verify(args.dir, args.tag, key=key)
        if args.ckpt_command == "diff":
            from trainguard.checkpoint.diff import diff, format_diff

            d = diff(args.a, args.b)
            print(json.dumps(d, indent=1) if args.json else format_diff(d))
            return 0
        return ck.ckpt_inspect(args.dir, args.tag)
    except CheckpointError as e:  # (a bad tag, an unreadable manifest: the message, never a traceback)
        print(f"trainguard ckpt {args.ckpt_command}: {e}", file=sys.stderr)
        return 1


def _run(args) -> int:
    """exec the command with trainguard's bootstrap first on PYTHONPATH (trainguard/bootstrap/site)."""
    import os
    from pathlib import Path

    command = list(args.command_line)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("trainguard run: give the command to run, e.g. trainguard run -- torchrun --nproc_per_node 8 "
              "train.py --deepspeed ds_config.json", file=sys.stderr)
        return 2
    from trainguard.support.prelaunch import check_command

    try:  # (before anything is launched: one message per job, not a traceback per rank after the framework's output)
        checked = check_command(command)
    except ConfigError as e:
        print(f"trainguard run: nothing launched -- {e}", file=sys.stderr)
        return 2
    for path, block in checked:
        if block is not None and getattr(block, "enabled", True):
            print(f"trainguard run: {path}: the trainguard block is valid", file=sys.stderr)
    if not checked:  # (a ds_config the script names itself -- TrainingArguments(deepspeed=...) -- is read by the ranks)
        print("trainguard run: launching; the block your script names (TrainingArguments(deepspeed=...), a ds_config "
              "it loads) is read when its engine is built, and a bad one stops the job there with one message -- "
              "`trainguard validate FILE` checks it before", file=sys.stderr)
    bootstrap = str(Path(__file__).resolve().parent / "bootstrap" / "site")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([bootstrap] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("TRAINGUARD_AUTO", "1")
    try:
        os.execvpe(command[0], command, env)
    except OSError as e:
        print(f"trainguard run: cannot run {command[0]!r}: {e.strerror}", file=sys.stderr)
        return 127


def _versions(args) -> int:
    """The support matrix beside what is installed here: exit 0 when every installed framework is inside it."""
    from trainguard.support import releases

    if args.constraints:
        print(releases.constraints(), end="")
        return 0
    outside = 0
    print(f"trainguard {__version__}: the support matrix (trainguard/support/releases.json, measured "
          f"{releases._matrix()['measured']}) and this environment")
    for key, version in releases.installed().items():
        p = releases.package(key)
        if version is None:
            verdict = "not installed"
        elif releases.supported(key, version):
            verdict = "supported"
        elif key == "megatron-lm" and releases.supported("megatron-core", version):
            verdict = "the adapter is supported; Megatron-LM's own loop needs a release in this range"  # (not an error)
        else:
            outside += 1
            why = p.outside.get(releases.series(version))
            verdict = f"OUTSIDE the matrix{': ' + why if why else ''} (refused at start; {releases.OVERRIDE}={key} runs it untested)"
        print(f"  {p.name}: supported {releases.describe(key)}; installed {version or '-'}: {verdict}")
    return 1 if outside else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="trainguard", description="Keep DeepSpeed and Megatron runs alive.")
    ap.add_argument("--version", action="version", version=f"trainguard {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)

    v = sub.add_parser("validate", help="validate the trainguard block of a ds_config file")
    v.add_argument("file")
    v.add_argument("--under", help="the adapter it will run under, as the listing without it names them (the "
                   "installed adapters' declarations): exit 2 when it refuses a key")
    v.set_defaults(func=_validate)

    d = sub.add_parser("demo", help="2-rank demo with injected faults, beside plain DeepSpeed")
    d.add_argument("--config", help="ds_config with a trainguard block (default: the packaged demo config)")
    d.add_argument("--steps", type=int, default=300)
    d.add_argument("--out", default="trainguard-demo", help="where logs and results go")
    d.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], help="override the config's ZeRO stage")
    d.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], help="override the config's precision")
    d.add_argument("--no-natural", action="store_true", help="leave out the natural failure (nothing injected: an "
                   "LR schedule raised mid-run) that follows the injected faults")
    d.set_defaults(func=_demo)

    dr = sub.add_parser("drill", help="fire drill: trainguard vs plain DeepSpeed under a schedule of faults")
    dr.add_argument("--steps", type=int, default=1000, help="drill length (the fault schedule scales with it)")
    dr.add_argument("--out", default="trainguard-drill", help="where logs, checkpoints and drill.json go")
    dr.set_defaults(func=_drill)

    vs = sub.add_parser("versions", help="the support matrix (DeepSpeed, transformers, Accelerate, megatron-core) "
                        "beside what this environment has installed; exit 1 when something is outside it")
    vs.add_argument("--constraints", action="store_true", help="print pip constraints that keep an install inside it")
    vs.set_defaults(func=_versions)

    rn = sub.add_parser("run", help="run a launch command with the zero-code entry (trainguard run -- torchrun ...)")
    rn.add_argument("command_line", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")
    rn.set_defaults(func=_run)

    r = sub.add_parser("report", help="a text summary (incidents, ranks, samples, rollbacks, goodput), then PNG "
                       "plots, from a trainguard JSONL log")
    r.add_argument("log")
    r.add_argument("--out", default="trainguard-report")
    r.set_defaults(func=_report)

    c = sub.add_parser("ckpt", help="list, verify or inspect a checkpoint directory")
    csub = c.add_subparsers(dest="ckpt_command", required=True)
    cl = csub.add_parser("list", help="tag, step, stable, size, verified")
    cl.add_argument("dir")
    cl.add_argument("--fast", action="store_true", help="check sizes only, not sha256")
    cv = csub.add_parser("verify", help="exit 0 when every file matches its manifest, else 1 naming the file")
    cv.add_argument("dir")
    cv.add_argument("tag", nargs="?")
    cv.add_argument("--key-env", metavar="NAME", help="also check each manifest's HMAC with the key in this "
                    "environment variable (checkpoint.hmac_key_env)")
    cd = csub.add_parser("diff", help="what changed between two checkpoints: lineage, layout, rollbacks and "
                         "quarantined samples in between")
    cd.add_argument("a", help="a checkpoint's tag directory (DIR/TAG)")
    cd.add_argument("b", help="a later one (DIR/TAG, the same run or a restarted one)")
    cd.add_argument("--json", action="store_true", help="the comparison as JSON")
    cs = csub.add_parser("sign", help="sign committed checkpoints (each verified against its sha256 manifest first) "
                         "for a job that turns checkpoint.hmac_key_env on")
    cs.add_argument("dir")
    cs.add_argument("tag", nargs="?")
    cs.add_argument("--key-env", metavar="NAME", required=True, help="the environment variable holding the key "
                    "(the one checkpoint.hmac_key_env names)")
    cs.add_argument("--old-key-env", metavar="NAME", help="a key rotation: the variable holding the key the "
                    "checkpoints were signed with; each is verified with it, then its verified manifest signed anew")
    ci = csub.add_parser("inspect", help="contents, lineage, health of one checkpoint")
    ci.add_argument("dir")
    ci.add_argument("tag")
    c.set_defaults(func=_ckpt)

    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
