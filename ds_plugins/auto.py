"""The zero-code entry: trainguard inside every ``deepspeed.initialize`` of the job.

Switched on by ``trainguard run -- <your launch command>`` (which puts a ``sitecustomize`` on the
workers' path: torchrun, the ``deepspeed`` launcher and ``accelerate launch`` all pass it on) or by
one line, ``import ds_plugins.auto``, before the engine is built. From then on:

- ``deepspeed.initialize`` -- called by you, by Hugging Face's Trainer or by Accelerate (which look
  it up at call time) -- goes through :func:`ds_plugins.initialize` when its config has an enabled
  ``"trainguard"`` block and the engine gets an optimizer: the full guard (watchdog, collective
  timeouts for the groups created from then on, automatic resume, the bf16-fallback recipe, ...).
  Without the block, with ``"enabled": false``, or for an engine without an optimizer
  (evaluation, inference), it is DeepSpeed's own call, untouched. trainguard's own call to
  ``deepspeed.initialize`` inside ``ds_plugins.initialize`` is never re-entered.
- under torchrun, a *restarted* attempt creates its default process group on a store prefix of its
  own, whoever creates it (the Trainer does, before any engine exists; so does Megatron-LM's
  ``initialize_megatron``): restarted gloo workers
  otherwise meet the addresses the failed attempt left in the store ("Gloo connectFullMesh
  failed"). The first attempt is left exactly as it is.
- ``Trainer.train()`` (or ``train(resume_from_checkpoint=True)``) resumes from the newest
  ``checkpoint-N`` in ``output_dir`` whose DeepSpeed checkpoint *verifies* (``checkpoint.resume``:
  "latest_valid", or "stable"; "none": HF decides as before): a job restarted by torchrun picks up
  where it was, past a torn or corrupted newest checkpoint. HF owns the rest of its resume (its
  trainer state, scheduler, data skipping); trainguard's own resume at initialize stays off under a
  framework, which would otherwise move the engine without the framework's loop.
- a training loader that Accelerate prepares (the Trainer's included) while the DeepSpeed config
  holds an enabled block is *tagged*: each batch carries its samples' dataset indices (and the
  sanitiser runs in its collate function), and the guarded engine takes them out again before the
  model sees the batch, so events name the culprit samples as with trainguard's own loader
  (trainguard/data/sample_tags.py). A batch with no room for them (a ``(features, labels)`` tuple, a tensor)
  travels wrapped and Accelerate's prepared loader hands it out unwrapped. A loader that cannot be
  tagged (an IterableDataset, no automatic batching) is named in the ``run_start`` record.

Nothing is imported early: the patches wait until ``deepspeed`` / ``accelerate`` are imported.
"""
from __future__ import annotations

import inspect
import os
import sys
import threading

from trainguard.bootstrap import AfterImport, flush, init_on_fresh_store, when_complete
from trainguard.bootstrap import wrap_once as _wrap
from trainguard.errors import ConfigError

_state = threading.local()
_WATCHED = ("deepspeed", "accelerate.accelerator", "accelerate.data_loader", "transformers.trainer")


def install() -> None:
    """Patch now what is imported, and the rest when it is (idempotent). A module still executing -- this
    entry loaded half-way through its import, e.g. by Accelerate's import inside ``transformers.trainer``
    (``from transformers import Trainer`` first) -- is patched once its code has returned, never before
    (trainguard.bootstrap.when_complete)."""
    flush()
    _patch_init_process_group()
    for name in _WATCHED:
        module = sys.modules.get(name)
        if module is not None:
            when_complete(module, _PATCHES[name])
    if not any(getattr(f, "names", None) == _WATCHED for f in sys.meta_path):
        sys.meta_path.insert(0, AfterImport(_WATCHED, lambda name, module: _PATCHES[name](module)))


def installed() -> bool:
    ds = sys.modules.get("deepspeed")
    return ds is not None and getattr(ds.initialize, "_trainguard", False)


# ---------------------------------------------------------------------------------- deepspeed
def _patch_deepspeed(ds) -> None:
    def make(original):
        signature = inspect.signature(original)

        def initialize(*args, **kwargs):
            if getattr(_state, "inside", False):  # trainguard's own call, from ds_plugins.initialize
                return original(*args, **kwargs)
            bound = signature.bind_partial(*args, **kwargs).arguments
            import ds_plugins
            try:
                if not _wants_guard(bound):
                    return original(*args, **kwargs)
                _state.inside = True
                return ds_plugins.initialize(**bound, _entry="auto")
            except ConfigError as e:
                _refused(e)
            finally:
                _state.inside = False
        return initialize

    _wrap(ds, "initialize", make)


def _refused(error: Exception) -> None:
    """A block the ranks refuse (every rank reads the same one): one short message for the job, from its first rank,
    and every rank exits 2 -- not a traceback from each rank inside the framework's own output (issue 53)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"[trainguard] the block is refused, nothing trained: {error}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _wants_guard(bound: dict) -> bool:
    """An enabled block, and an engine that will train (an optimizer, given or configured)."""
    from ds_plugins import _raw_config
    from trainguard import config as tg_config

    ds_dict, block = tg_config.load(_raw_config(bound.get("args"), bound.get("config"), bound.get("config_params")))
    if block is None or not block.enabled:
        return False
    configured = isinstance(ds_dict, dict) and "optimizer" in ds_dict
    return bound.get("optimizer") is not None or bound.get("model_parameters") is not None or configured


# ---------------------------------------------------------------------------------- process group
def _patch_init_process_group() -> None:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    def make(original):
        def init_process_group(*args, **kwargs):
            return init_on_fresh_store(original, args, kwargs)
        return init_process_group

    _wrap(c10d, "init_process_group", make)
    dist.init_process_group = c10d.init_process_group


# ---------------------------------------------------------------------------------- accelerate
def _patch_accelerate(module) -> None:
    def make(original):
        def prepare_data_loader(self, data_loader, *args, **kwargs):
            try:  # (your loop's loader, before its engine is built: a bad block is refused here, as at the build)
                block = _block_of(self)
            except ConfigError as e:
                _refused(e)
            if block is not None:
                from ds_plugins.capabilities import FRAMEWORK_HINTS
                from trainguard.ports import tag_loader

                tag_loader(data_loader, block.sanitize, FRAMEWORK_HINTS["refill"])
            return original(self, data_loader, *args, **kwargs)
        return prepare_data_loader

    _wrap(module.Accelerator, "prepare_data_loader", make)

    def make_init(original):
        def __init__(self, *args, **kwargs):
            # the Trainer builds its Accelerator in its own __init__, so transformers.trainer has finished its
            # import by now: a patch deferred while it was still executing lands before Trainer.train runs
            flush()
            return original(self, *args, **kwargs)
        return __init__

    _wrap(module.Accelerator, "__init__", make_init)


def _patch_accelerate_loaders(module) -> None:
    """Accelerate's prepared loaders hand out a wrapped batch (one with no room for the ids: a tuple, a
    tensor) unwrapped, its ids left for the next forward (trainguard.data.sample_tags.untag). Batches trainguard
    did not wrap pass untouched."""
    def make(original):
        def __iter__(self):
            from trainguard.ports import untag

            for batch in original(self):
                yield untag(batch)
        return __iter__

    for name in ("DataLoaderShard", "DataLoaderDispatcher", "SkipDataLoader"):
        cls = getattr(module, name, None)
        if cls is not None and "__iter__" in vars(cls):
            _wrap(cls, "__iter__", make)


def _block_of(accelerator):
    """The enabled trainguard block of an Accelerator's DeepSpeed config, else None."""
    plugin = getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None)
    raw = getattr(plugin, "deepspeed_config", None) if plugin is not None else None
    if not isinstance(raw, dict) or "trainguard" not in raw:
        return None
    from trainguard import config as tg_config

    block = tg_config.parse_block(raw["trainguard"])
    return block if block.enabled else None


# ---------------------------------------------------------------------------------- HF Trainer
def _patch_trainer(module) -> None:
    def make(original):
        def train(self, resume_from_checkpoint=None, *args, **kwargs):
            try:
                block = _block_of_args(self.args)
            except ConfigError as e:
                _refused(e)

            def once(resume, again: bool = False):
                if block is not None and (again or block.checkpoint.resume != "none" and resume in (None, True)):
                    from trainguard.ports import key_from, newest_resumable_folder

                    mode = "latest_valid" if block.checkpoint.resume == "none" else block.checkpoint.resume
                    chosen = newest_resumable_folder(self.args.output_dir, mode, key_from(block.checkpoint), again)
                    if chosen is not None:
                        resume = chosen
                out = original(self, resume, *args, **kwargs)
                # the run is over: its last save committed, run_end and the incidents closed -- the Trainer never destroys
                # its engine (each train() builds its engine anew, so a later call is guarded afresh)
                session = getattr(getattr(self, "model_wrapped", None), "_trainguard", None)
                if session is not None:
                    session.close()
                return out

            from trainguard.ports import World

            if block is not None:
                _told_its_length(self)
            hf = getattr(self.args, "hf_deepspeed_config", None)  # (ZeRO-3: restarts whole -- ds_plugins.inprocess)
            if block is None or World.current is None or World.current.rank is None or hf is not None and hf.is_zero3():
                return once(resume_from_checkpoint)
            from ds_plugins.inprocess import let_go_of_trainer
            from trainguard.ports import reentering

            # a supervised job: entered again on the survivors after a rank died, from the newest checkpoint-N that
            # verifies, as torchrun's restart would -- in the same processes, a spare in the dead rank's place (whose
            # first entry resumes from the same checkpoint); what the user gave the Trainer is given back between
            given = (self.optimizer, self.lr_scheduler)
            return reentering(lambda again: once(resume_from_checkpoint, again), lambda: let_go_of_trainer(self, given),
                              told=True)()
        return train

    _wrap(module.Trainer, "train", make)


def _told_its_length(trainer) -> None:
    """The run's last step, once the Trainer knows it (``state.max_steps`` at ``on_train_begin``; its own schedule is
    built after the engine): what a restart may throw away (trainguard.recovery.lrcut.LrHistory.no_room)."""
    from transformers import TrainerCallback

    class TrainguardRunLength(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            guarded = getattr(trainer.model_wrapped, "_trainguard", None)
            if guarded is not None and guarded.session.lr_history is not None and state.max_steps > 0:
                guarded.session.lr_history.last_step = int(state.max_steps)
    if not any(type(c).__name__ == "TrainguardRunLength" for c in trainer.callback_handler.callbacks):
        trainer.add_callback(TrainguardRunLength())


def _block_of_args(args):
    """The enabled block of a TrainingArguments' DeepSpeed config (a path or a dict), else None."""
    given = getattr(args, "deepspeed", None)
    raw = getattr(getattr(args, "hf_deepspeed_config", None), "config", None) or given
    if not raw:
        return None
    from trainguard import config as tg_config

    # (the Trainer read the user's file into a dict: its errors name the file)
    _, block = tg_config.load(raw, str(given) if isinstance(given, (str, os.PathLike)) else None)
    return block if block is not None and block.enabled else None


_PATCHES = {"deepspeed": _patch_deepspeed, "accelerate.accelerator": _patch_accelerate,
            "accelerate.data_loader": _patch_accelerate_loaders, "transformers.trainer": _patch_trainer}

install()
