"""trainguard's start-up hooks, shared by every adapter (no adapter imports another's).

- ``site/``: the folder ``trainguard run`` puts first on PYTHONPATH. Its ``sitecustomize`` costs nothing
  until a framework is imported (DeepSpeed, Accelerate: ``ds_plugins.auto``; Megatron-LM's
  ``megatron.training``: ``megatron_hooks.lm``), then loads that adapter's zero-code entry; ``_trainguard_hook``
  (a sibling it imports without importing trainguard) holds ``AfterImport`` and ``wrap_once``.
- :func:`init_on_fresh_store` / :func:`attempt_store`: a restarted torchrun attempt's process group on a store
  prefix of its own, whatever the framework; under ``trainguard.supervise``, trainguard's world (trainguard.liveness.spare).

- ``default_group``: the default process group as the block asks for it, opened before a framework builds its own.

May import trainguard.liveness (a supervised job's world) and below; the site folder imports no trainguard module until a
framework is imported (then the adapter's entry: the one place the core names an adapter, .importlinter).
"""
from __future__ import annotations

import inspect
import os

from trainguard.bootstrap.site._trainguard_hook import AfterImport, flush, when_complete, wrap_once

__all__ = ["AfterImport", "wrap_once", "when_complete", "flush", "init_on_fresh_store", "attempt_store"]


def attempt_store(timeout):
    """torchrun's store, under a prefix of this restart attempt's own: restarted gloo workers
    otherwise meet the peer addresses the failed attempt left there ("Gloo connectFullMesh failed").
    Returns ``(store, rank, world, timeout)`` for ``init_process_group``."""
    import torch.distributed as dist

    env = os.environ
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size=world,
                          is_master=not agent_store and rank == 0, timeout=timeout,
                          **({} if agent_store else {"multi_tenant": True}))
    attempt = env["TORCHELASTIC_RESTART_COUNT"]
    return dist.PrefixStore(f"trainguard/attempt_{attempt}", store), rank, world, timeout


def init_on_fresh_store(original, args, kwargs):
    """``init_process_group``: in a restarted torchrun attempt, on a store prefix of the attempt's own
    (unless the caller chose its store or init method); under ``trainguard.supervise``, trainguard's world
    (trainguard.liveness.spare.form). Installed by the bootstrap itself in a restarted or supervised attempt,
    whatever the framework (site/sitecustomize.py), and by ds_plugins.auto."""
    import os

    import torch.distributed.distributed_c10d as c10d

    bound = inspect.signature(original).bind_partial(*args, **kwargs).arguments
    env = os.environ
    if "TRAINGUARD_ROLE" in env and bound.get("store") is None and bound.get("init_method") in (None, "env://"):
        # under trainguard.supervise: the world is trainguard's, formed on the job's generation store -- a spare
        # waits here, inside the framework's first init_process_group, until a rank is handed to it (its barriers
        # then pass until it enters the training function: trainguard.liveness.spare)
        from trainguard.liveness.spare import form

        backend = bound.get("backend")
        form(str(backend) if backend is not None else None, bound.get("timeout") or c10d.default_pg_timeout,
             window=True)
        return None
    restarted = int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    if (restarted and "MASTER_ADDR" in env and "RANK" in env and bound.get("store") is None
            and bound.get("init_method") in (None, "env://") and env.get("TRAINGUARD_FRESH_STORE", "1") != "0"):
        store, rank, world, timeout = attempt_store(bound.get("timeout") or c10d.default_pg_timeout)
        bound.update(store=store, rank=rank, world_size=world, timeout=timeout)
        bound.pop("init_method", None)
    return original(**bound)
