"""A survivor's way through a rank's replacement in the same job (issue 38), for every adapter.

Under ``trainguard.supervise`` a collective that fails on a survivor because a rank died is survived where the
adapter calls its framework (:func:`surviving`): the adapter's old run on this rank is closed (its guard,
``clean=False``: node memory kept), the adapter lets go of its framework's state and with it the old groups
(``teardown``), the world is formed again with the spare (trainguard.world), and the adapter builds its framework
again the way the spare builds its first -- the same calls, so the same collectives -- and resumes from the newest
snapshot every rank holds (``rebuild``). The lowest survivor writes ``rank_replaced``. Any other failure is raised
as it was.
"""
from __future__ import annotations

import gc
import sys
import time
from typing import Any, Callable

from trainguard.events import Record


def surviving(world, call: Callable[[], Any], replace: Callable[[str], None], stale: Callable[[], Any] = lambda: None):
    """``call()``; a failure a rank's death explains: ``replace(why)`` (an adapter: its part around
    :func:`replace_rank`), then ``stale()`` stands for what the interrupted call would have returned (``world``
    None: not supervised, ``call()`` alone)."""
    if world is None:
        return call()
    err = None
    try:
        return call()
    except RuntimeError as e:
        err = e
    if not world.replaced():
        raise err
    why = f"{type(err).__name__}: {err}"
    err = None  # (the exception's frames hold the failed work, and with it the old group's sockets)
    replace(why)
    return stale()


def replace_rank(world, session, why: str, teardown: Callable[[], None], rebuild: Callable[[], Any]) -> dict:
    """The survivor's part. ``rebuild()`` returns the new run's session and the step it resumed at."""
    start = time.monotonic()
    session.close({"interrupted": why[:200]}, clean=False)
    teardown()
    gc.collect()  # (what still held the old groups: their sockets close, and a peer waiting on this rank fails now)
    formed = world.reform()
    new_session, step, interrupted = rebuild()
    built = time.monotonic() - start - formed
    dead, died, at = world.ledger.failure(world.generation)
    detail = {"rank": dead, "why": died, "generation": world.generation, "survivor_error": why[:300],
              "fault_to_world_s": round(time.time() - at - built, 3), "reformed_s": round(formed, 3),
              "rebuilt_s": round(built, 3), "resumed_at_step": step, "interrupted_at_step": interrupted,
              "sockets_left_open": len(world.left_open)}
    if new_session.guard is not None and world.rank == (1 if dead == 0 else 0):  # (the lowest survivor)
        new_session.guard.emit(step, Record.RANK_REPLACED, [dead], None, detail, takeover=world.rank != 0)
    print(f"[trainguard rank {world.rank}] rank {dead} died ({died}): the world formed again in {formed:.3f} s "
          f"(generation {world.generation}), resumed at step {step} {built:.3f} s later", file=sys.stderr,
          flush=True)
    return detail


def replacing_hung(watchdog, verdict, kill_local: Callable[[], Any]) -> bool:
    """The watchdog's hung ranks in a supervised job (on every live rank; trainguard.watchdog): their processes end --
    killed on this host at once, by their supervisors elsewhere -- and spares take their places, instead of every
    rank exiting for a restart. Asked once per watchdog. False: not supervised."""
    from trainguard.world import Ledger, World

    if not World.supervised():
        return False
    if getattr(watchdog, "replacing", False):
        return True
    watchdog.replacing = True
    import os

    from trainguard.attempt import generation

    ledger = Ledger.connect()
    if ledger.generation() > generation():
        # the world moved on without this rank: a replacement is under way (the others, rebuilding, are silent),
        # and this rank is still blocked in the old world (bench/kill_anywhere.py met it once in 4 draws). Gloo
        # cannot abort that wait: the process ends, as if killed, and a spare -- or the job's restart -- takes it
        print(f"[trainguard rank {watchdog.rank}] blocked in generation {generation()} while the world formed "
              f"generation {ledger.generation()}: this process ends for a spare; its stacks:", file=sys.stderr,
              flush=True)
        import faulthandler

        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        os.kill(os.getpid(), 9)
    w, live = watchdog.cfg.distributed.watchdog, [r for r in range(watchdog.world) if r not in verdict.culprits]
    first = bool(live) and watchdog.rank == live[0]
    watchdog.guard.emit(watchdog.heart.step, Record.HANG_DETECTED, verdict.culprits, "replace", {
        "culprits": [dict(c, coords=watchdog.guard.coords_of(c["rank"])) for c in verdict.describe()],
        "why": verdict.why, "hang_timeout_s": w.hang_timeout_s, "detected_by": watchdog.rank},
        rank_local=True, to_run_log=first, takeover=first)
    if first:
        for r in verdict.culprits:
            ledger.request_kill(r)
    kill_local()
    return True
