"""A supervised training process (trainguard.supervise, trainguard.liveness.world) over plain torch.distributed: each step an
all-reduce of every rank's contribution, a snapshot of the state kept in memory each step (the stand-in for the
node-memory tier, which the adapters will restore from), a kill at a chosen step. After a failed collective the
survivors form the world again (World.reform) and every rank restores the newest step all of them hold; a spare
that takes a rank gets that step from rank 0. Writes ``<out>/end_rank<r>.json`` (and ``start_rank<r>.json``)."""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from trainguard.liveness.world import World

OUT = Path(sys.argv[1])
STEPS = int(os.environ.get("STEPS", "30"))
KILL_RANK, KILL_STEP = int(os.environ.get("KILL_RANK", "-1")), int(os.environ.get("KILL_STEP", "-1"))
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

world = World()
rank = world.join()
if rank is None:  # a spare the job never needed
    sys.exit(0)
(OUT / f"start_rank{rank}_{world.role}.json").write_text(json.dumps({"pid": os.getpid(), "attempt": ATTEMPT}))
held: dict[int, torch.Tensor] = {0: torch.zeros(4, dtype=torch.float64)}  # step -> state after it


def restore() -> tuple[int, torch.Tensor]:
    """The newest step every rank holds (a spare holds none: it gets rank 0's copy of that step)."""
    newest = torch.tensor([max(held) if world.role == "active" or len(held) > 1 else 2 ** 40], dtype=torch.int64)
    dist.all_reduce(newest, op=dist.ReduceOp.MIN)
    step = int(newest)
    state = held.get(step, torch.zeros(4, dtype=torch.float64)).clone()
    dist.broadcast(state, 0)
    held.clear()
    held[step] = state.clone()
    return step, state


step, x = 0, held[0].clone()
if world.role == "spare":
    step, x = restore()
reformed = []
while step < STEPS:
    if rank == KILL_RANK and step == KILL_STEP and world.generation == 0 and ATTEMPT == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    failed = False
    try:
        t = torch.full((4,), float(rank + 1), dtype=torch.float64)
        dist.all_reduce(t)
    except RuntimeError:
        failed = True
    if failed:  # (outside the except: the exception would hold the failed work and its sockets)
        reformed.append(world.reform())
        step, x = restore()
        continue
    x += t
    step += 1
    held[step] = x.clone()
    for old in [s for s in held if s < step - 3]:
        del held[old]
    time.sleep(0.01)
(OUT / f"end_rank{rank}.json").write_text(json.dumps({
    "pid": os.getpid(), "role": world.role, "generation": world.generation, "x": x.tolist(), "step": step,
    "reformed_s": reformed, "attempt": ATTEMPT, "connections_left_open": len(world.left_open)}))
dist.destroy_process_group()
