"""DeepSpeed's part in a dead rank's replacement in the same job (trainguard.supervise, trainguard.liveness.world,
trainguard.liveness.replacement).

Under ``trainguard.supervise`` ``ds_plugins.initialize`` forms the world (a spare waits there, warm, until a rank is
handed to it). On a survivor whose collective failed because a rank died, DeepSpeed's engine is retired -- its
hooks, the gradients the interrupted backward accumulated, its state and DeepSpeed's group globals let go -- and,
once the world is formed again, built again through ``ds_plugins.initialize``'s own build, as the spare builds its
first: the same ``deepspeed.initialize``, ``attach`` and resume from node memory. The user's engine object becomes
the new engine (one shared ``__dict__``, as after a bf16 fallback) and the user's loader goes on from the restored
data position; the interrupted step's remaining calls do nothing. Under HF's Trainer (ds_plugins.auto) the
survivors' ``Trainer.train`` is entered again instead (trainguard.liveness.replacement.reentering), once the Trainer and its
Accelerator let go of the engine (:func:`let_go_of_trainer`).
"""
from __future__ import annotations

import weakref

from ds_plugins.precision import _retire
from trainguard.ports import forget_framework, reentered, replace_rank


def why_not(recipe, engine, entry: str = "own") -> str | None:
    """Why a survivor cannot build this engine again as the spare builds its first (None: it can; "": the
    framework's entry is entered again instead -- HF's Trainer.train, trainguard.liveness.replacement.reentering)."""
    zero3 = "ZeRO-3 partitions the parameters on the old world's groups" if engine.zero_optimization_stage() == 3 \
        else None
    if reentered():  # (its teardown retires it, even before the framework holds it: let_go_of_trainer)
        _BUILT.add(engine)
        return ""
    if zero3 or entry == "auto":
        return zero3 or ("under the zero-code entry the engine, its resume and its wrappers are your loop's "
                         "(Accelerate's, or yours): only HF's Trainer.train is entered again")
    if recipe is None or recipe.why_not:
        return recipe.why_not if recipe is not None else "the DeepSpeed config was not a dict trainguard read"
    if recipe.mpu is not None:
        return "an mpu of yours holds the model-parallel groups, which die with the world"
    return None


_BUILT = weakref.WeakSet()  # the engines built under trainguard.liveness.replacement.reentering (their teardown retires them)


def replace_lost_rank(state, why: str, discard: bool) -> None:
    """On a survivor (``state``: its ds_plugins.engine.EngineGuard), with trainguard.liveness.replacement.replace_rank."""
    from deepspeed.utils import groups

    engine, loader = state.engine, state.loader
    module, interrupted = engine.module, engine.global_steps + 1

    def teardown():
        _retire(engine)
        object.__setattr__(engine, "__dict__", {})  # the old engine, its optimizer and their groups, let go
        forget_framework(module, groups)  # (DeepSpeed's attributes on the parameters, its module-level groups)

    def rebuild():
        new_engine, new_state = state.rebuild(module, loader)
        object.__setattr__(engine, "__dict__", new_engine.__dict__)
        new_state.engine, new_state.discard = engine, discard  # (the user's object: a next replacement retires it)
        return new_state.session, engine.global_steps, interrupted

    replace_rank(state.world, state.session, why, teardown, rebuild)


def let_go_of_trainer(trainer, given) -> None:
    """A survivor's teardown under HF's Trainer: Accelerate's references dropped, DeepSpeed's engine retired (as in
    replace_lost_rank), the Trainer's model, optimizer and scheduler as given, DeepSpeed's attributes and groups gone."""
    from deepspeed.utils import groups

    accelerator, handler = trainer.accelerator, trainer.callback_handler
    accelerator.deepspeed_engine_wrapped = None  # (its free_memory would destroy the engine: retired below)
    accelerator.free_memory()
    handler.optimizer = handler.lr_scheduler = handler.train_dataloader = None
    for engine in list(_BUILT):
        _BUILT.discard(engine)
        if "optimizer" in vars(engine):  # (not retired yet)
            _retire(engine)
            object.__setattr__(engine, "__dict__", {})
    trainer.model_wrapped, trainer.deepspeed, (trainer.optimizer, trainer.lr_scheduler) = trainer.model, None, given
    forget_framework(trainer.model, groups)
