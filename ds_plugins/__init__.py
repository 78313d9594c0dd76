"""DeepSpeed adapter: ``ds_plugins.initialize`` is ``deepspeed.initialize`` with trainguard inside.

    import ds_plugins
    engine, optimizer, loader, scheduler = ds_plugins.initialize(
        model=model, model_parameters=model.parameters(), training_data=dataset,
        config="ds_config.json")           # the same file, with a "trainguard" block
    for batch in loader:
        loss = engine(batch)
        engine.backward(loss)
        engine.step()                       # the guard decides here: apply or skip, on every rank

With no "trainguard" block, or ``"enabled": false``, this *is* ``deepspeed.initialize``: the same
arguments are passed through and the same objects come back, untouched.
"""
from __future__ import annotations

from typing import Any

from trainguard import config as tg_config
from trainguard.errors import ConfigError, TrainguardAbort, TrainguardError

__all__ = ["initialize", "attach", "alive", "close", "ConfigError", "TrainguardAbort", "TrainguardError"]


def _deepspeed():
    try:
        import deepspeed
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise TrainguardError("ds_plugins needs DeepSpeed: pip install 'trainguard[deepspeed]' "
                              f"(import failed: {e})") from None
    return deepspeed


def _raw_config(args, config, config_params) -> Any:
    if config is not None:
        return config
    if config_params is not None:
        return config_params
    return getattr(args, "deepspeed_config", None) if args is not None else None


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, distributed_port=None, mpu=None, dist_init_required=None,
               collate_fn=None, config=None, mesh_param=None, config_params=None, _entry: str = "initialize"):
    """Same signature and return value as ``deepspeed.initialize``.

    The config is read and the block validated *before* anything is initialised, so a bad block
    fails fast with a :class:`ConfigError` naming every problem. When the block is active and
    ``training_data`` is given, the returned loader is a :class:`trainguard.data.position.TrackedLoader`
    that knows each batch's sample ids and the data position.
    """
    deepspeed = _deepspeed()
    kwargs = dict(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                  training_data=training_data, lr_scheduler=lr_scheduler, mpu=mpu,
                  dist_init_required=dist_init_required, collate_fn=collate_fn, config=config,
                  mesh_param=mesh_param, config_params=config_params)
    if distributed_port is not None:
        kwargs["distributed_port"] = distributed_port

    raw = _raw_config(args, config, config_params)
    ds_dict, block = tg_config.load(raw)
    if block is None or not block.enabled:
        return deepspeed.initialize(**kwargs)
    from ds_plugins.capabilities import REFUSED
    from trainguard.ports import check_supported

    # what the block may ask for depends on whose loader feeds the engine (ds_plugins/capabilities.py)
    check_supported(block, "ds_plugins" if training_data is not None else
                    "ds_plugins/framework" if _entry == "auto" else "ds_plugins/own", REFUSED)
    check_releases(block, framework=_entry == "auto")

    # We hand DeepSpeed the dict we already parsed (unless it came through args, which DeepSpeed
    # insists on reading itself), and build the loader ourselves.
    if config is not None or config_params is not None:
        kwargs["config"], kwargs["config_params"] = ds_dict, None
    kwargs["training_data"] = None
    world = _process_group(deepspeed, block, kwargs)
    if world is not None:  # (kept: a survivor builds again with the same groups, on its parameters as they were)
        from trainguard.ports import remember_attributes

        remember_attributes(kwargs["model"])
        if model_parameters is not None:
            kwargs["model_parameters"] = list(model_parameters)
    recipe = None
    if isinstance(ds_dict, dict):  # what a bf16 fallback needs to build the engine again
        from ds_plugins.precision import recipe_for

        recipe = recipe_for(ds_dict, optimizer, lr_scheduler, mpu)

    def rebuild(module, loader):
        """A survivor's engine, built again on the new world the way the spare builds its first (ds_plugins.inprocess)."""
        trainable = [p for p in module.parameters() if p.requires_grad]
        again = dict(kwargs, model=module, lr_scheduler=recipe.lr_scheduler,
                     optimizer=recipe.optimizer(trainable) if recipe.optimizer else None)
        if again.get("model_parameters") is None:
            again["model_parameters"] = trainable
        engine, _, _, _, state = _build(deepspeed, again, block, recipe, lr_scheduler, _entry, None, collate_fn,
                                        world, rebuild, loader)
        return engine, state

    engine, opt, loader, scheduler, state = _build(deepspeed, kwargs, block, recipe, lr_scheduler, _entry,
                                                   training_data, collate_fn, world, rebuild if world else None)
    if world is not None:
        from ds_plugins.inprocess import why_not

        off = why_not(recipe, engine, _entry)
        if off is not None:  # (not rebuilt in place: re-entered, or the survivors exit and torchrun restarts the job)
            state.rebuild = None
        if off:
            import warnings

            warnings.warn(f"trainguard.supervise: a dead rank cannot be replaced in this job ({off}); it restarts "
                          "whole instead", stacklevel=2)
    return engine, opt, loader, scheduler


def _build(deepspeed, kwargs, block, recipe, lr_scheduler, _entry, training_data, collate_fn, world, rebuild,
           loader=None):
    """The engine, guarded, its loader and the resume -- at the start, and on a survivor after a rank was replaced
    (``loader``: the user's, carried on)."""
    engine, opt, _, scheduler = deepspeed.initialize(**kwargs)

    from ds_plugins.engine import attach

    # under a framework (zero-code entry) the LR schedule is often its own, invisible here: unknown, not absent
    state = attach(engine, block, client_scheduler=lr_scheduler if lr_scheduler is not None or _entry != "auto"
                   else "the framework's", entry=_entry)
    state.recipe = recipe
    state.world, state.rebuild = world, rebuild
    if loader is not None:  # (the user's loader goes on, reporting to the new guard)
        loader.listener = state.on_batch
        loader.sample_hook = state.sample_hook if state.faults is not None else None
        state.loader = loader
    if training_data is not None:
        import torch.distributed as dist

        from trainguard.ports import TrackedLoader  # (here: `import ds_plugins`, at DeepSpeed's import, stays light)

        group = getattr(engine, "data_parallel_group", None)
        dp_rank = dist.get_rank(group) if dist.is_initialized() else 0
        dp_world = dist.get_world_size(group) if dist.is_initialized() else 1
        loader = TrackedLoader(training_data, engine.train_micro_batch_size_per_gpu(), dp_rank, dp_world,
                               cfg=block.data, collate_fn=collate_fn, listener=state.on_batch,
                               sanitize_cfg=block.sanitize,
                               sample_hook=state.sample_hook if state.faults is not None else None)
        state.loader = loader
    # with checkpoint.dir: clear what a crash left in staging, resume from the newest checkpoint that
    # verifies (the checkpoint manager) -- except under a framework, whose resume it is (ds_plugins/auto.py)
    state.session.running(resume=_entry != "auto")
    return engine, opt, loader, scheduler, state


def _process_group(deepspeed, block, kwargs):
    """The default process group as the block asks for it, before DeepSpeed builds its own groups
    (trainguard.bootstrap.default_group): under ``trainguard.supervise`` the world, returned to be formed again when a rank
    dies; else DeepSpeed opens it, with ``distributed.collective_timeout_s`` when set."""
    from trainguard.ports import open_default_group

    # (``warm``: what a spare imports while it waits -- what a first deepspeed.initialize imports on the way)
    world, td = open_default_group(block.distributed, _backend, who="ds_plugins.initialize", depth=2,
                                   warm=("torch._dynamo", "deepspeed.runtime.zero.muon.muon_optimizer"))
    if td is not None:
        extra = {"distributed_port": kwargs["distributed_port"]} if "distributed_port" in kwargs else {}
        deepspeed.init_distributed(timeout=td, **extra)
    return world


def _backend() -> str:
    """DeepSpeed's accelerator's backend, or gloo when torch lacks it (e.g. ccl on a plain CPU)."""
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    name = get_accelerator().communication_backend_name()
    try:
        return name if dist.is_backend_available(name) else "gloo"
    except Exception:  # noqa: BLE001 - older torch without is_backend_available
        return name


def attach(engine, block: dict | tg_config.TrainguardConfig):
    """Guard an engine that was built by ``deepspeed.initialize`` (when you cannot change that call)."""
    from ds_plugins.capabilities import REFUSED
    from ds_plugins.engine import attach as _attach
    from trainguard.ports import check_supported

    cfg = block if isinstance(block, tg_config.TrainguardConfig) else tg_config.parse_block(block)
    check_supported(cfg, "ds_plugins/own", REFUSED)  # (your loader: no sanitiser, data position or skipping)
    check_releases(cfg, framework=False)
    return _attach(engine, cfg)


RELEASES: dict = {"checked": {}, "untested": []}  # what check_releases found (the run_start record)


def check_releases(block, framework: bool) -> dict:
    """The support matrix (trainguard/support/releases.json), before anything is built: DeepSpeed's release, and --
    under the zero-code entry, when they are the ones building the engine (on the call stack) -- transformers' and
    Accelerate's.
    A release outside it stops the run here, naming the supported ranges and the override; a key of the
    block that cannot run on that release is refused by name."""
    import sys

    from trainguard.ports import check_release, releases

    found = {"deepspeed": _deepspeed().__version__}
    if framework:  # (the frameworks on the call stack: a loop of yours that imports transformers for a model is yours)
        callers = set()
        frame = sys._getframe(1)
        while frame is not None:
            callers.add(str(frame.f_globals.get("__name__", "")).split(".")[0])
            frame = frame.f_back
        for key in ("transformers", "accelerate"):
            version = getattr(sys.modules.get(key), "__version__", None)
            if key in callers and isinstance(version, str):
                found[key] = version
    untested = [key for key, version in found.items() if not releases.check(key, version)]
    for key, version in found.items():
        check_release(block, key, version)
    RELEASES.update(checked=found, untested=untested)
    return RELEASES


def alive(engine, phase: str = "eval") -> None:
    """Tell the watchdog this rank is making progress outside training steps (e.g. a long
    evaluation through ``engine.module`` rather than ``engine(...)``, which counts by itself).
    Without it, a pause longer than ``distributed.watchdog.hang_timeout_s`` reads as a hang."""
    state = getattr(engine, "_trainguard", None)
    if state is not None:
        state.heart.beat(phase)


def close(engine) -> None:
    """Write the run_end record and close the logs (also done by ``engine.destroy()``)."""
    state = getattr(engine, "_trainguard", None)
    if state is not None:
        state.close()


