"""The default process group as the block asks for it, opened before a framework builds its own groups (an adapter
that builds the framework -- ds_plugins.initialize -- calls it; where the groups exist before trainguard is in, the
keys are refused: megatron_hooks/capabilities.py).

- ``distributed.collective_timeout_s``: every group honours it. Groups created without an explicit timeout (DeepSpeed's
  ZeRO groups) take torch's module default at creation time, so that default is set, and the default group is
  opened with it.
- ``distributed.fresh_store_per_attempt`` (under torchrun): the group is opened on
  ``PrefixStore("trainguard/attempt_<TORCHELASTIC_RESTART_COUNT>", store)``, so that workers of a restart attempt
  never meet keys (gloo peer addresses) left by the attempt before (trainguard.bootstrap.attempt_store).
- Under ``trainguard.supervise`` the world is trainguard's (trainguard.liveness.spare.form): returned, to be formed again when
  a rank dies.
"""
from __future__ import annotations

import os
import warnings
from datetime import timedelta
from typing import Callable


def open_default(distributed, backend: Callable[[], str], warm: tuple[str, ...] = (), who: str = "the adapter",
                 depth: int = 0):
    """Returns ``(world, timeout)``: the supervised job's :class:`trainguard.liveness.world.World` (or None), and the timeout
    the framework is to open the default group with itself (None: it is open already, or none was asked for).
    ``backend()``: the framework's backend; ``warm``: what a spare imports while it waits (trainguard.liveness.spare.form);
    ``who``: named in the warning when the group existed already, which points ``depth`` frames above the caller
    (the adapter's own calls between the user's line and this one)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from trainguard.bootstrap import attempt_store
    from trainguard.liveness.spare import close_window, form
    from trainguard.liveness.world import World

    td = timedelta(seconds=distributed.collective_timeout_s) if distributed.collective_timeout_s else None
    if td is not None:
        c10d.default_pg_timeout = td
        if isinstance(getattr(c10d, "default_pg_nccl_timeout", None), timedelta):
            c10d.default_pg_nccl_timeout = td
    if World.supervised() and not dist.is_initialized():
        return form(backend(), td or c10d.default_pg_timeout, warm=warm), None
    if dist.is_initialized():
        if td is not None:
            warnings.warn(f"trainguard: the default process group existed before {who}, so its timeout stays as it "
                          "was; groups created from now on use distributed.collective_timeout_s",
                          stacklevel=2 + depth)
        if World.current is not None and World.current.rank is not None:  # (formed at the framework's
            close_window()                                                 # init_process_group: trainguard.liveness.spare)
            return World.current, None
        return None, None
    if distributed.fresh_store_per_attempt and "TORCHELASTIC_RESTART_COUNT" in os.environ and \
            "MASTER_ADDR" in os.environ:
        store, rank, world, timeout = attempt_store(td or c10d.default_pg_timeout)
        dist.init_process_group(backend(), store=store, rank=rank, world_size=world, timeout=timeout)
        return None, None
    return None, td
