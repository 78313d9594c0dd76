"""One rank's supervisor: the training process runs as its child, so that a dead training process does not end
the job, and a hot spare takes its rank (the launch and the world; DeepSpeed's part is
ds_plugins/inprocess.py, the survivors' trainguard/liveness/replacement.py).

    torchrun --nproc-per-node 5 -m trainguard.supervise --spares 1 -- train.py --your-args

(without ``--spares``: ``trainguard.distributed.spares`` of the config file the command names -- after
``--deepspeed_config``, ``--deepspeed``, ``--config`` or ``--trainguard-config``, or any ``.json`` argument with a
trainguard block.)

torchrun (its agent) stops every worker as soon as one exits, whatever ``--max-restarts`` says -- measured: the
survivors got SIGTERM within milliseconds of one worker's SIGKILL. Its workers are these supervisors: a training
process that dies leaves its supervisor running, and the job with it. Of torchrun's ``N + S`` workers, the last
``S`` are spares: their training processes start like the others (imports done, the model's code loaded) and wait
at the process group's creation (:mod:`trainguard.liveness.world`) until a rank is handed to them.

A hung training process (SIGSTOP, a stuck device) is named by the watchdog of the live ranks, which, in a supervised
job, asks for its end instead of exiting: its supervisor kills it, and it is a dead one.

When a training process is killed (a signal: SIGKILL by the OOM killer or a watchdog, a segfault), its supervisor
-- the one process that knows it for sure -- hands its rank to the next spare and opens the next *generation* on
torchrun's store: the survivors, whose collectives failed, form the world again on that generation's store prefix, with the spare in the dead
rank's place, and their processes go on (their pids unchanged). With no spare left, the supervisor exits with the
training process's code: torchrun stops the job and restarts it whole (``--max-restarts``), as without
supervision -- and says so. A training process that exits by itself with a code other than 0 (an abort, an error,
the watchdog's exit for a restart) is not replaced: a spare would meet the same; nor is one that dies once ranks
have begun to finish.

The supervisor stays until every rank's training process has finished (exited 0: its supervisor says so on the
store), then exits 0. torchrun's SIGTERM or SIGINT (the job stopped) goes on to its training process.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from trainguard.liveness.world import ROLE, SPARE, Ledger

POLL_S = 0.2
STOP_GRACE_S = 20.0  # (below torchrun's 30 s SIGTERM grace)


def _say(rank: int, text: str) -> None:
    print(f"[trainguard.supervise rank {rank}] {text}", file=sys.stderr, flush=True)


def child_env(env: dict, rank: int, world: int, spares: int) -> dict:
    """The training process's environment: an active rank keeps its rank in a world of the active ranks; a spare
    has no rank until one is handed over."""
    active = world - spares
    out = {**env, "WORLD_SIZE": str(active), "TRAINGUARD_SPARES": str(spares)}
    if rank < active:
        out.update({ROLE: "active", "RANK": str(rank)})
    else:
        out.update({ROLE: "spare", SPARE: str(rank - active), "RANK": "-1"})
    return out


def _command(cmd: list[str]) -> list[str]:
    if not cmd:
        raise SystemExit("trainguard.supervise: no training command after --")
    return [sys.executable, *cmd] if cmd[0].endswith(".py") or cmd[0] == "-m" else cmd


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainguard.supervise")
    parser.add_argument("--spares", type=int, default=None, help="how many of torchrun's workers wait as hot spares "
                        "(default: trainguard.distributed.spares of the config file on the command line, else 0)")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the training script and its arguments")
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if args.spares is None:
        args.spares = spares_in(cmd)
    env = os.environ
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        raise SystemExit(f"trainguard.supervise runs as torchrun's worker: {', '.join(missing)} not set")
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    if not 0 <= args.spares < world:
        raise SystemExit(f"trainguard.supervise: --spares {args.spares} leaves no active rank of {world}")
    active = world - args.spares
    ledger = Ledger.connect(env)
    child = None

    def stop(sig, _frame):  # (the job stopped: so does the training process -- waited for, then killed)
        if child is not None:
            child.send_signal(sig)
            try:
                child.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                child.kill()
        sys.exit(128 + sig)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    child = subprocess.Popen(_command(cmd), env=child_env(dict(env), rank, world, args.spares))
    spare = rank - active if rank >= active else None
    while (rc := child.poll()) is None:  # (a watchdog that found this rank hung asks for its process's end)
        holds = rank if spare is None else ledger.handed(spare)
        if holds is not None and ledger.kill_requested(holds):
            _say(rank, f"rank {holds}'s training process (pid {child.pid}) was found hung: killed for a spare")
            child.kill()
        time.sleep(POLL_S)
    holds = rank if spare is None else ledger.handed(spare)
    if rc == 0:
        if holds is not None:  # (a training process that held a rank finished: the job waits for every rank's)
            ledger.store.add("finished", 1)
        return 0
    if holds is None:  # (a spare that never held a rank: out of the pool, nothing to hand over)
        ledger.spare_lost(spare)
        _say(rank, f"spare {spare}'s training process (pid {child.pid}) ended with {_how(rc)} before it held a rank")
        ledger.wait_finished(active)
        return 0
    if rc > 0 or ledger.finished():
        # (it exited by itself -- an abort, an error, the watchdog's exit for a restart --, or the job is ending:
        # a spare would meet the same; torchrun stops or restarts the job, as without supervision)
        return rc if rc > 0 else 128 - rc
    handed = ledger.hand_over(holds, args.spares, f"pid {child.pid}, {_how(rc)}")
    if handed is None:
        _say(rank, f"rank {holds}'s training process (pid {child.pid}) ended with {_how(rc)} and no spare is left: "
                   "the whole job stops and restarts (torchrun --max-restarts)")
        return 128 - rc
    taken, generation = handed
    _say(rank, f"rank {holds}'s training process (pid {child.pid}) ended with {_how(rc)}: spare {taken} takes rank "
               f"{holds}, generation {generation}")
    ledger.wait_finished(active)
    return 0


CONFIG_FLAGS = ("--trainguard-config", "--deepspeed_config", "--deepspeed-config", "--deepspeed", "--config")


def spares_in(cmd: list[str]) -> int:
    """``trainguard.distributed.spares`` of the config the training command names (after one of CONFIG_FLAGS, or any
    ``.json`` argument whose file has a trainguard block); 0 without one."""
    from trainguard import config as tg_config
    from trainguard.errors import ConfigError

    for i, arg in enumerate(cmd):
        flag, _, value = arg.partition("=")
        named = value if flag in CONFIG_FLAGS and value else cmd[i + 1] if arg in CONFIG_FLAGS and i + 1 < len(cmd) \
            else None
        path = named or (arg if arg.endswith(".json") else None)
        # (a .json argument not named as a config: read only when small -- it may be a dataset)
        if not path or not os.path.isfile(path) or not named and os.path.getsize(path) > (1 << 20):
            continue
        try:
            data = tg_config.read_json(path)
        except ConfigError:
            continue  # (not a config: a dataset's JSON, say)
        if tg_config.BLOCK in data or flag == "--trainguard-config":  # (that one may hold the block itself)
            # (a bad block: its error, naming the file, here too)
            return tg_config.parse_block(data.get(tg_config.BLOCK, data), path).distributed.spares
    return 0


def _how(rc: int) -> str:
    return f"signal {-rc}" if rc < 0 else f"exit code {rc}"

if __name__ == "__main__":
    sys.exit(main())
