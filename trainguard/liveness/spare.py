"""A training process's way into a supervised job's world (trainguard.supervise, trainguard.liveness.world): forming
it (:func:`form`), and what a spare meets between joining and its first entry into the training function.

A spare runs the user's script from its top, like any rank, and waits where the world forms -- inside the
framework's first ``init_process_group`` under the zero-code entry (HF's ``TrainingArguments``, Accelerate's
state). Once a rank is handed to it, it runs what the script does before the training function (loading the model,
the data) -- which the survivors, re-entering the training function, do not run again:

- a *barrier* there (``main_process_first`` around a dataset's ``map``, Accelerate's ``wait_for_everyone``) has no
  peer: the survivors passed it long ago, and what it ordered (the main process's cache) is done. On the spare, the
  default group's barriers return at once until its first entry (:func:`form` with ``window=True``).
- any other collective there (an ``evaluate()`` before ``train()``, a second ``train()`` of a multi-phase script)
  cannot be matched. Every rank says which call of the training function it enters (:func:`same_entry`, on the
  store, never a collective): a spare in another call than the survivors stops them all with an error naming it --
  the job restarts whole -- instead of collectives paired wrongly.
"""
from __future__ import annotations

import sys
from datetime import timedelta

_WINDOW: list = []  # the barrier a spare's window replaced (restored at its first entry)


def form(backend: str | None, timeout=None, warm: tuple[str, ...] = ("torch._dynamo",), window: bool = False):
    """This training process's place in a supervised job's world (trainguard.liveness.world), formed before its framework's
    first collective: by ``init_process_group`` itself under the zero-code entry (trainguard.bootstrap), by an
    adapter before its framework's build. A spare waits here until a rank is handed to it -- meanwhile importing
    ``warm`` (what a first build imports on the way: torch._dynamo behind an optimizer's constructor, ~1.3 s on
    CPU) -- and its ``RANK`` becomes that rank; one the job never needed ends here (exit 0). ``window``: the spare's
    barriers pass until its first entry (above). ``timeout``: the world's collectives' (default 30 minutes)."""
    import importlib
    import os

    import torch

    from trainguard.liveness.world import World

    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    check_backend(backend)
    world = World(backend=backend, **({"timeout": timeout} if timeout is not None else {}))
    for name in warm if world.role == "spare" else ():
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a release without it: nothing to warm
            pass
    if world.join() is None:
        sys.exit(0)  # a spare the job never needed
    os.environ["RANK"] = str(world.rank)
    if torch.cuda.is_available() and "LOCAL_RANK" in os.environ:  # (a framework that finds the world formed
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))    # skips its own set_device)
    if window and world.role == "spare":
        _open_window()
    return world


def _open_window() -> None:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    originals = (dist.barrier, c10d.barrier)

    def barrier(group=None, async_op=False, *args, **kwargs):
        if group is None or group is dist.group.WORLD:  # (the survivors passed this barrier long ago)
            return _Done() if async_op else None
        return originals[1](group, async_op, *args, **kwargs)

    _WINDOW.append((originals, barrier))
    dist.barrier = c10d.barrier = barrier


class _Done:
    """What a barrier that passed returns to a caller that asked for its work (``async_op=True``)."""

    def wait(self, *args, **kwargs) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def close_window() -> None:
    """The spare's barriers real again: at its first entry, or where an adapter builds its framework outside one
    (DeepSpeed's ``initialize`` in a loop of your own)."""
    if _WINDOW:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        (mine, theirs), ours = _WINDOW.pop()
        if dist.barrier is ours:  # (one patched since by someone else stays)
            dist.barrier = mine
        if c10d.barrier is ours:
            c10d.barrier = theirs


def same_entry(world, call: int) -> None:
    """At a spare's first entry and the survivors' re-entry in this generation: every rank says which call of the
    training function it enters, on the store (waiting at most the world's timeout for the others: a spare may
    still be loading its model); the spare's barriers are real again. Raises when they differ."""
    close_window()
    import time

    store, gen = world.ledger.store, world.generation
    store.set(f"entry/{gen}/{world.rank}", str(call))
    keys = [f"entry/{gen}/{r}" for r in range(world.size)]
    limit = world.timeout.total_seconds() if isinstance(world.timeout, timedelta) else 1800.0
    deadline = time.monotonic() + limit
    while not store.check(keys):  # (polled: a death meanwhile -- the spare's, while it loads -- ends the wait)
        if world.ledger.generation() > gen:
            raise RuntimeError(f"trainguard.supervise: a rank died while the world of generation {gen} entered the "
                               "training function")
        if time.monotonic() > deadline:
            from trainguard.errors import UnsupportedSetup

            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            raise UnsupportedSetup(f"trainguard.supervise: rank(s) {missing} did not enter the training function "
                                   f"within {limit:.0f} s after a rank died: the spare runs your script from its top, "
                                   "and a collective of it before the training function (an evaluate() before "
                                   "train()) has no peer -- the survivors do not run it again. The job restarts whole")
        time.sleep(0.01)
    calls = {r: int(v) for r, v in enumerate(store.multi_get(keys))}
    if len(set(calls.values())) > 1:
        from trainguard.errors import UnsupportedSetup

        raise UnsupportedSetup(f"trainguard.supervise: after a rank died, the ranks entered different calls of the "
                               f"training function (rank: call {calls}): the spare runs your script from its top, "
                               "and it calls the training function more than once before this one (a multi-phase "
                               "script), which the survivors do not run again. The job restarts whole; keep one "
                               "training call per process under trainguard.supervise")


def check_backend(backend: str) -> None:
    """A dead rank is replaced in the same job on gloo only, for now."""
    if backend != "gloo":
        from trainguard.errors import UnsupportedSetup

        raise UnsupportedSetup(f"trainguard.supervise replaces a dead rank in the same job on gloo only, for now (this "
                               f"job's backend: {backend}): NCCL's watchdog aborts a survivor's process when a peer "
                               "dies. Launch without trainguard.supervise: a dead rank restarts the job (torchrun "
                               "--max-restarts), which resumes from node memory")
