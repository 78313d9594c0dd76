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
    world.sever()  # (first: a group destroyed in the teardown would wait for its work in flight)
    _LIVE.clear()
    session.close({"interrupted": why[:200]}, clean=False)
    teardown()
    gc.collect()  # (what still held the old groups: their sockets close, and a peer waiting on this rank fails now)
    formed = world.reform()
    new_session, step, interrupted = rebuild()
    return _replaced(_facts(world, why, start, formed, interrupted), new_session, step)


def _facts(world, why: str, start: float, formed: float, interrupted: int | None) -> dict:
    """What a replacement was, taken when the world formed again (a second one may follow before the report)."""
    dead, died, at = world.ledger.failure(world.generation)
    return {"me": world.rank, "start": start, "formed": formed, "at": at, "detail": {
        "rank": dead, "why": died, "generation": world.generation, "survivor_error": why[:300],
        "reformed_s": round(formed, 3), "interrupted_at_step": interrupted, "connections_shut": world.severed,
        "connections_left_open": len(world.left_open)}}


def _replaced(facts: dict, session, step: int) -> dict:
    """The ``rank_replaced`` record (by the lowest survivor) and the line on stderr, once the new run resumed."""
    built = time.monotonic() - facts["start"] - facts["formed"]
    d = {**facts["detail"], "fault_to_world_s": round(time.time() - facts["at"] - built, 3),
         "rebuilt_s": round(built, 3), "resumed_at_step": step}
    dead, me = d["rank"], facts["me"]
    if session.guard is not None and me == (1 if dead == 0 else 0):  # (the lowest survivor)
        session.guard.emit(step, Record.RANK_REPLACED, [dead], None, d, takeover=me != 0)
    print(f"[trainguard rank {me}] rank {dead} died ({d['why']}): the world formed again in {facts['formed']:.3f} s "
          f"(generation {d['generation']}), resumed at step {step} {built:.3f} s later", file=sys.stderr, flush=True)
    return d


def remember_attributes(model) -> None:
    """The attributes ``model``'s parameters have before a framework's first build (:func:`forget_framework`)."""
    for p in model.parameters():
        if not hasattr(p, "_trainguard_own"):
            p._trainguard_own = frozenset(vars(p)) | {"_trainguard_own"}


def forget_framework(model=None, *modules) -> None:
    """A survivor's teardown: the attributes a framework left on ``model``'s parameters since
    :func:`remember_attributes` (DeepSpeed's ``_dp_group``, ``_hp_mapping``, bound ``get_full_hp_*``: they hold the old
    world's groups, their gloo sockets open -- a survivor blocked on this rank then waits for its collective's
    timeout) and their gradients (what an interrupted backward accumulated would join the next step's); and the
    process groups ``modules`` keep in their globals (set None; dicts of them emptied)."""
    import torch.distributed as dist

    for p in model.parameters() if model is not None else ():
        p.grad = None
        for k in [k for k in vars(p) if k not in getattr(p, "_trainguard_own", vars(p))]:
            delattr(p, k)
    for module in modules:
        for name, value in list(vars(module).items()):
            if isinstance(value, dist.ProcessGroup) or isinstance(value, (list, tuple)) and value and \
                    all(isinstance(v, dist.ProcessGroup) for v in value):
                setattr(module, name, None)
            elif isinstance(value, dict) and any(isinstance(v, dist.ProcessGroup) for v in value.values()):
                value.clear()


def check_backend(backend: str) -> None:
    """A dead rank is replaced in the same job on gloo only, for now."""
    if backend != "gloo":
        from trainguard.errors import UnsupportedSetup

        raise UnsupportedSetup(f"trainguard.supervise replaces a dead rank in the same job on gloo only, for now (this "
                               f"job's backend: {backend}): NCCL's watchdog aborts a survivor's process when a peer "
                               "dies. Launch without trainguard.supervise: a dead rank restarts the job (torchrun "
                               "--max-restarts), which resumes from node memory")


_PENDING: list[dict] = []  # a re-entered training function's replacements, reported once its new run resumed
_LIVE: list = []  # the session of this process's run, in a supervised job (closed when its function is re-entered)


def reentering(train: Callable, teardown: Callable[[], int | None], backend: str = "gloo", timeout=None) -> Callable:
    """``train`` entered again in the same process after a rank died, for a framework whose own entry builds
    everything (Megatron-LM's ``pretrain``: the shape of NVIDIA resiliency-ext's ``inprocess.Wrapper``, on
    trainguard.world). The world is formed before the first entry (a spare waits there until a rank is handed to
    it; ``RANK`` is set to its rank). When ``train`` raises because a rank died, ``teardown()`` lets go of the
    framework's state and groups (it returns the step the run was in, or None), the world is formed again with the
    spare, and ``train`` is entered again: it builds the framework on the new world and resumes from the newest
    snapshot every rank holds, and the session reports ``rank_replaced`` once it resumed (:func:`running`). Any other
    failure is raised as it was. ``timeout``: the world's collectives' (a timedelta; default 30 minutes)."""
    import functools
    import os

    from trainguard.world import World

    check_backend(backend)

    @functools.wraps(train)
    def run(*args, **kwargs):
        world = World(backend=backend, **({"timeout": timeout} if timeout is not None else {}))
        if world.join() is None:
            sys.exit(0)  # a spare the job never needed
        os.environ["RANK"] = str(world.rank)
        import torch

        if torch.cuda.is_available() and "LOCAL_RANK" in os.environ:  # (the framework finds the world formed:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))    # it skips its own set_device)
        while True:
            why = None
            try:
                done = train(*args, **kwargs)
                _LIVE.clear()  # (the finished run's session: nothing of it is kept)
                return done
            except Exception as e:  # noqa: BLE001 - a rank's death, or raised as it was
                if not world.replaced():
                    raise
                why = f"{type(e).__name__}: {e}"
            # (outside the except: its traceback held the failed work, and with it the old groups' sockets)
            start = time.monotonic()
            world.sever()  # (first: a group destroyed in the teardown would wait for its work in flight)
            live = _LIVE.pop() if _LIVE else None
            if live is not None:  # (the run's guard, closed with node memory kept -- if its adapter did not already)
                live.close({"interrupted": why[:200]}, clean=False)
            interrupted = teardown()
            if interrupted is None and live is not None:
                interrupted = live.fw.completed_steps() + 1
            live = None
            gc.collect()
            formed = world.reform()
            _PENDING.append(_facts(world, why, start, formed, interrupted))

    return run


def running(session, step: int) -> None:
    """From a run's session once it resumed (trainguard.session), in a supervised job: the ports its groups listen on
    published (trainguard.world.World.sever), and the replacement that re-entered it reported."""
    from trainguard.world import World

    if World.current is not None and World.current.rank is not None:
        from trainguard.metrics.prometheus import LISTENING

        World.current.publish(exclude=tuple(LISTENING))
        _LIVE[:] = [session]
    elif session.cfg.distributed.spares and session.rank == 0 and not World.supervised():
        import warnings

        warnings.warn(f"trainguard.distributed.spares is {session.cfg.distributed.spares}, but this job was not "
                      "launched under trainguard.supervise (torchrun ... -m trainguard.supervise -- your script): no "
                      "spare waits, a dead rank restarts the job", stacklevel=2)
    while _PENDING:
        _replaced(_PENDING.pop(0), session, step)


def _end_if_left_behind(rank: int, gen: int) -> None:
    """This process still in generation ``gen`` (its collective did not fail): its stacks, then its end."""
    import faulthandler
    import os

    from trainguard.attempt import generation

    if generation() == gen:
        print(f"[trainguard rank {rank}] still in generation {gen} after its groups' connections were shut: this "
              "process ends for a spare; its stacks:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        os.kill(os.getpid(), 9)


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
        # and this rank is still blocked in the old world. Its groups' connections shut down, its collective fails
        # and it joins the next generation like any survivor; where none could be (no world here), the process
        # ends, as if killed, and a spare -- or the job's restart -- takes it
        world = World.current
        severed = world.sever() if world is not None else 0
        print(f"[trainguard rank {watchdog.rank}] blocked in generation {generation()} while the world formed "
              f"generation {ledger.generation()}: " + (f"{severed} connections of its groups shut down, its "
              "collective fails and it joins the next generation" if severed else "this process ends for a spare; "
              "its stacks:"), file=sys.stderr, flush=True)
        if severed:  # (and if this rank was stuck elsewhere, it ends after all -- as below -- for a spare)
            import threading

            gen = generation()
            timer = threading.Timer(watchdog.cfg.distributed.watchdog.hang_timeout_s, _end_if_left_behind,
                                    args=(watchdog.rank, gen))  # (nothing of the old run held meanwhile)
            timer.daemon = True
            timer.start()
            return True
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
