"""Put first on PYTHONPATH by ``trainguard run``, so that every Python process of the job (torchrun's
workers, the deepspeed launcher's, accelerate launch's) loads trainguard's zero-code entry.

It costs nothing until DeepSpeed, Accelerate or Megatron-LM's ``megatron.training`` is imported:
only then is ``ds_plugins.auto`` imported (which patches ``deepspeed.initialize``; ds_plugins/auto.py),
or ``megatron_hooks.lm`` (which adds ``--trainguard-config`` to Megatron-LM's arguments and guards its
loop when it is given). In a restarted torchrun attempt, ``init_process_group`` is also wrapped as
soon as torch defines it, so that any framework's process group starts on a store of the attempt's
own (under ``trainguard.supervise``, in every attempt: trainguard's world, where a spare waits).
The sitecustomize this one shadows, if the environment has one, still runs.
``TRAINGUARD_AUTO=0`` turns it off. An entry that cannot be loaded (trainguard broken or missing in the
workers' environment) stops the job at that import, naming why -- a job launched under ``trainguard run``
never trains unguarded by surprise; ``TRAINGUARD_REQUIRED=0`` lets it go on with a warning instead.
"""
import importlib.util
import os
import sys

from _trainguard_hook import AfterImport, wrap_once  # (a sibling: this folder is on sys.path)

_WATCHED = ("deepspeed", "accelerate", "megatron.training")


def _load_entry(name="deepspeed", module=None):  # (each entry installs itself once; later calls are no-ops)
    try:
        import ds_plugins.auto  # (installs itself at its first import: a restarted attempt's process group, any framework)

        ds_plugins.auto.install()  # (again: patches what was imported since, and what had not finished its import)

        if name == "megatron.training":
            from megatron_hooks.lm import install_entry

            install_entry()
    except Exception as e:  # noqa: BLE001
        why = f"trainguard: the zero-code entry could not be loaded: {type(e).__name__}: {e}"
        if os.environ.get("TRAINGUARD_REQUIRED", "1") != "0":  # fail closed: not a run the user believes guarded
            raise SystemExit(f"{why}\nThe job was launched under `trainguard run` and would train unguarded: stopped. "
                             "Repair the installation (pip install trainguard in the workers' environment), or set "
                             "TRAINGUARD_REQUIRED=0 to train without it.") from e
        print(f"{why} (TRAINGUARD_REQUIRED=0: training goes on unguarded)", file=sys.stderr)


def _chain():
    """Run the sitecustomize this file shadows (the next one on sys.path), as Python would have."""
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if os.path.abspath(entry or os.getcwd()) == here:
            continue
        candidate = os.path.join(entry or os.getcwd(), "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_trainguard_shadowed_sitecustomize", candidate)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return


def _fresh_store(name, c10d):
    """A restarted torchrun attempt, whatever the framework (a megatron-core script of your own too):
    ``init_process_group`` on a store prefix of the attempt's own; a supervised training process: trainguard's world
    (trainguard.bootstrap.init_on_fresh_store, imported when it is called, once torch is whole)."""
    def make(original):
        def init_process_group(*args, **kwargs):
            from trainguard.bootstrap import init_on_fresh_store

            return init_on_fresh_store(original, args, kwargs)
        return init_process_group

    wrap_once(c10d, "init_process_group", make)


if os.environ.get("TRAINGUARD_AUTO", "1") != "0":
    for _name in _WATCHED:
        if _name in sys.modules:
            _load_entry(_name)
    sys.meta_path.insert(0, AfterImport(_WATCHED, _load_entry))
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0 or "TRAINGUARD_ROLE" in os.environ:
        # (a restarted attempt, or a supervised training process -- trainguard.supervise; the first attempt of an
        # unsupervised job: untouched)
        sys.meta_path.insert(0, AfterImport(("torch.distributed.distributed_c10d",), _fresh_store))
_chain()
