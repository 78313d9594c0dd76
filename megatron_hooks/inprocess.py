"""Megatron-LM's part in a dead rank's replacement in the same job (trainguard.supervise, trainguard.liveness.world,
trainguard.liveness.replacement.reentering).

Megatron-LM's entry scripts hand ``pretrain`` to ``inprocess_restart.maybe_wrap_for_inprocess_restart`` (NVIDIA
resiliency-ext's ``inprocess.Wrapper`` with ``--inprocess-restart``: NCCL >= 2.26.2 and CUDA, so not on gloo). Under
``trainguard.supervise`` that wrapper is trainguard's, with or without the flag: the world formed before
``pretrain`` (Megatron-LM then finds torch.distributed initialized and builds its groups on it; a spare waits there,
warm, until a rank is handed to it), and on a survivor whose collective failed because a rank died, Megatron-LM's
global state let go (its ``destroy_global_state``: arguments, microbatch calculator, model-parallel groups, rerun
state machine; the guard's run, closed with node memory kept) and ``pretrain`` entered again on the world formed
again: the same build as the spare's, resumed from the newest snapshot every rank holds.
"""
from __future__ import annotations

_LET_GO = [lambda: None]  # () -> the guard's run, taken and forgotten: megatron_hooks.lm's (this module imports it never)


def install(let_go) -> None:
    """Megatron-LM's ``maybe_wrap_for_inprocess_restart`` wrapped (idempotent; a release without it: nothing)."""
    _LET_GO[0] = let_go
    try:
        from megatron.training import inprocess_restart
    except ImportError:
        return
    from trainguard.bootstrap import wrap_once

    wrap_once(inprocess_restart, "maybe_wrap_for_inprocess_restart", wrap_pretrain)


def wrap_pretrain(wrap):
    """Megatron-LM's ``maybe_wrap_for_inprocess_restart``, trainguard's under trainguard.supervise (returns
    ``(pretrain, store)`` as Megatron-LM's does; the store None: the world is formed already)."""
    def maybe_wrap_for_inprocess_restart(pretrain):
        from datetime import timedelta

        from trainguard.errors import UnsupportedSetup
        from trainguard.ports import World, reentering

        if not World.supervised():
            return wrap(pretrain)
        from megatron.training import arguments

        args = arguments.parse_args(ignore_unknown_args=True)
        if not getattr(args, "trainguard_config", None):
            raise UnsupportedSetup("trainguard.supervise runs Megatron-LM with --trainguard-config: a replaced rank "
                                   "resumes from trainguard's snapshots (trainguard.checkpoint.snapshot)")
        return reentering(_with_arguments_as_parsed(pretrain), teardown, args.distributed_backend,
                          timedelta(minutes=getattr(args, "distributed_timeout_minutes", 10) or 10)), None

    return maybe_wrap_for_inprocess_restart


def supervised(train, backend: str = "gloo", timeout=None):
    """Your own megatron-core loop under trainguard.supervise: ``train()`` -- the whole run: the model-parallel groups
    built on the world trainguard formed (``init_process_group`` only where ``torch.distributed`` is not initialized
    yet), the model, the optimizer, ``megatron_hooks.install`` (which resumes from node memory), the loop from
    ``guard.iteration`` -- entered again on the survivors after a rank died, as Megatron-LM's ``pretrain()`` is.
    ``backend``: your loop's (gloo only, for now: NCCL is refused by name); ``timeout``: the world's collectives' (a
    timedelta). Not supervised: ``train`` itself."""
    from trainguard.ports import World, reentering

    return reentering(train, _let_go, backend, timeout) if World.supervised() else train


def _let_go() -> None:
    """A survivor's megatron-core let go before your training function is entered again (its guard is closed by the
    core): the model-parallel groups (and those destroy_model_parallel leaves behind), the microbatch calculator,
    the rerun state machine and the global memory buffer, which a second initialisation would refuse."""
    import importlib

    from megatron.core import parallel_state

    from trainguard.ports import forget_framework

    parallel_state.destroy_model_parallel()
    forget_framework(None, parallel_state)
    for module, name in (("megatron.core.num_microbatches_calculator", "destroy_num_microbatches_calculator"),
                         ("megatron.core.rerun_state_machine", "destroy_rerun_state_machine"),
                         ("megatron.core.parallel_state", "destroy_global_memory_buffer")):
        destroy = getattr(importlib.import_module(module), name, None)
        if destroy is not None:
            destroy()


def _with_arguments_as_parsed(pretrain):
    """core_v0.18+: the script parses its arguments before ``pretrain()``, which reads them from Megatron-LM's globals
    and moves their counters on (consumed samples, iteration): each entry after the first starts from a copy of them
    as they were at the first (core_v0.17's ``pretrain()`` parses them itself)."""
    import copy
    import functools
    import inspect

    from megatron.training import get_args, global_vars, training

    parsed = []

    @functools.wraps(pretrain)
    def entered(*args, **kwargs):
        if "cfg_container" in inspect.signature(training.pretrain).parameters:
            if parsed:
                global_vars.set_global_variables(copy.deepcopy(parsed[0]))
            else:
                parsed.append(copy.deepcopy(get_args()))
        return pretrain(*args, **kwargs)

    return entered


def teardown() -> int | None:
    """A survivor's Megatron-LM let go before ``pretrain`` is entered again. Returns the iteration it was in."""
    from megatron.training import async_utils, get_args, global_vars, training
    from trainguard.ports import forget_framework

    run = _LET_GO[0]()
    interrupted = run.guard.iteration + 1 if run is not None else None
    if run is not None:
        run.close(clean=False)  # (closed already where train() raised: the guard's run is not entered twice)

    args = get_args() if global_vars._GLOBAL_ARGS is not None else None  # (None: let go already -- a second death)
    if args is not None and hasattr(async_utils, "reset_persistent_async_worker"):  # (a save in flight: the old world's)
        try:
            async_utils.reset_persistent_async_worker(getattr(args, "async_strategy", "nvrx"))
        except Exception:  # noqa: BLE001 - no async save ever started: nothing to reset
            pass
    training.destroy_global_state()
    from megatron.core import parallel_state

    forget_framework(None, parallel_state)  # (groups destroy_model_parallel leaves behind: their sockets)
    return interrupted
