"""A survivor's way through a rank's replacement in the same job, for every adapter.

Under ``trainguard.supervise`` a collective that fails on a survivor because a rank died is survived where the
adapter calls its framework (:func:`surviving`): the adapter's old run on this rank is closed (its guard,
``clean=False``: node memory kept), the adapter lets go of its framework's state and with it the old groups
(``teardown``), the world is formed again with the spare (trainguard.liveness.world), and the adapter builds its framework
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
    start, formed, _ = _next_generation(world, why, session, teardown)
    new_session, step, interrupted = rebuild()
    return _replaced(_facts(world, why, start, formed, interrupted), new_session.guard, step)


def _next_generation(world, why: str, session, teardown: Callable[[], int | None]) -> tuple[float, float, int | None]:
    """A survivor's way to the next generation: its groups' connections shut (first: a group destroyed in the
    teardown would wait for its work in flight), its run's guard closed with node memory kept, the framework let go
    of (``teardown``: it returns the step the run was in, or None), what still held the old groups collected (their
    sockets close: a peer waiting on this rank fails now) and the world formed again. Returns (when it began, the
    seconds the world took to form again, the interrupted step or None)."""
    start = time.monotonic()
    world.sever()
    _LIVE.clear()
    if session is not None:
        session.close({"interrupted": why[:200]}, clean=False)
    done = session.fw.completed_steps() if session is not None else None  # (before the teardown lets go of it)
    del session
    interrupted = teardown()
    if interrupted is None and done is not None:
        interrupted = done + 1
    gc.collect()
    return start, world.reform(), interrupted


def _facts(world, why: str, start: float, formed: float, interrupted: int | None) -> dict:
    """What a replacement was, taken when the world formed again (a second one may follow before the report)."""
    dead, died, at = world.ledger.failure(world.generation)
    return {"me": world.rank, "start": start, "formed": formed, "at": at, "detail": {
        "rank": dead, "why": died, "generation": world.generation, "survivor_error": why[:300],
        "reformed_s": round(formed, 3), "interrupted_at_step": interrupted, "connections_shut": world.severed,
        "connections_left_open": len(world.left_open)}}


def _replaced(facts: dict, guard, step: int) -> dict:
    """The ``rank_replaced`` record (by the lowest survivor) and the line on stderr, once the new run resumed."""
    built = time.monotonic() - facts["start"] - facts["formed"]
    d = {**facts["detail"], "fault_to_world_s": round(time.time() - facts["at"] - built, 3),
         "rebuilt_s": round(built, 3), "resumed_at_step": step}
    dead, me = d["rank"], facts["me"]
    if guard is not None and me == (1 if dead == 0 else 0):  # (the lowest survivor)
        guard.emit(step, Record.RANK_REPLACED, [dead], None, d, takeover=me != 0)
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


_PENDING: list[dict] = []  # a re-entered training function's replacements, reported once its new run resumed
_LIVE: list = []  # the session of this process's run, in a supervised job (closed when its function is re-entered)
_REENTERING: list = []  # the worlds of the training functions being run by reentering (innermost last)
_CALLS = [0]  # how many times this process entered a training function under reentering (a spare: since it joined)


def reentered() -> bool:
    """Whether a training function is running under :func:`reentering` (its framework's build is entered again after
    a death: an adapter then rebuilds nothing in place)."""
    return bool(_REENTERING)


def reentering(train: Callable, teardown: Callable[[], int | None], backend: str = "gloo", timeout=None,
               told: bool = False) -> Callable:
    """``train`` entered again in the same process after a rank died, for a framework whose own entry builds
    everything (Megatron-LM's ``pretrain``, HF's ``Trainer.train``: the shape of NVIDIA resiliency-ext's
    ``inprocess.Wrapper``, on trainguard.liveness.world). The world is formed before the first entry (:func:`form`, unless
    the zero-code entry formed it already at the framework's ``init_process_group``). When ``train`` raises because
    a rank died, ``teardown()`` lets go of the framework's state and groups (it returns the step the run was in, or
    None), the world is formed again with the spare, and ``train`` is entered again: it builds the framework on the
    new world and resumes from the newest snapshot or checkpoint every rank holds, and the session reports
    ``rank_replaced`` once it resumed (:func:`running`). Any other failure is raised as it was. ``told``: ``train`` is
    called with ``again=True`` when it must resume (entered again, or a spare's first entry in a later generation)."""
    import functools

    import torch.distributed as dist

    from trainguard.liveness.spare import check_backend
    from trainguard.liveness.world import World

    check_backend(backend)

    @functools.wraps(train)
    def run(*args, **kwargs):
        from trainguard.liveness.spare import form

        formed = World.current is not None and World.current.rank is not None and dist.is_initialized()
        world = World.current if formed else form(backend, timeout)
        _REENTERING.append(world)
        try:
            return _entered(world, train, teardown, args, kwargs, told)
        finally:
            _REENTERING.pop()

    return run


def _entered(world, train: Callable, teardown: Callable[[], int | None], args, kwargs, told: bool):
    """:func:`reentering`'s loop."""
    from trainguard.liveness.spare import same_entry

    again = world.generation > 0 and _CALLS[0] == 0  # (a spare's first entry, in a dead rank's place)
    _CALLS[0] += 1
    while True:
        why = None
        try:
            if again:  # (the survivors and the spare enter the same call of the script, or none goes on)
                same_entry(world, _CALLS[0])
            done = train(*args, **({"again": again} if told else {}), **kwargs)
            _LIVE.clear()  # (the finished run's session: nothing of it is kept)
            return done
        except Exception as e:  # noqa: BLE001 - a rank's death, or raised as it was
            if not world.replaced():
                raise
            why = f"{type(e).__name__}: {e}"
        # (outside the except: its traceback held the failed work, and with it the old groups' sockets)
        start, formed, interrupted = _next_generation(world, why, _LIVE.pop() if _LIVE else None, teardown)
        again = True
        _PENDING.append(_facts(world, why, start, formed, interrupted))


def running(session, step: int, resumed: bool = True) -> None:
    """From a run's session once it resumed (trainguard.step.session), in a supervised job: the ports its groups listen on
    published (trainguard.liveness.world.World.sever), and the replacement that re-entered it reported -- or, where the resume
    is the framework's own (``resumed`` False: HF's Trainer loads its checkpoint later), once it loaded
    (:func:`report_pending`, from trainguard.checkpoint.loading)."""
    from trainguard.liveness.world import World

    if World.current is not None and World.current.rank is not None:
        from trainguard.metrics.prometheus import LISTENING

        World.current.publish(exclude=tuple(LISTENING))
        _LIVE[:] = [session]
    elif session.cfg.distributed.spares and session.rank == 0 and not World.supervised():
        import warnings

        warnings.warn(f"trainguard.distributed.spares is {session.cfg.distributed.spares}, but this job was not "
                      "launched under trainguard.supervise (torchrun ... -m trainguard.supervise -- your script): no "
                      "spare waits, a dead rank restarts the job", stacklevel=2)
    if resumed:
        report_pending(session.guard, step)


def report_pending(guard, step: int) -> None:
    """The replacements that re-entered this run, reported now that it resumed at ``step``."""
    while _PENDING:
        _replaced(_PENDING.pop(0), guard, step)
