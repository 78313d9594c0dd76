"""Which adapter honours which key of the block: the one source for the check at start and for the
config reference's per-adapter column.

Every leaf key is honoured by every adapter unless it is listed in :data:`REFUSED` for one. A key
an adapter cannot honour is refused *when the user set it* (to a value that would do something):
``install``/``initialize`` raise :class:`ConfigError` naming the key, the adapter and why -- a key
that is set and silently does nothing would lie to the user. Defaults are never refused.
"""
from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any, Iterator

from pydantic import BaseModel

from trainguard.errors import ConfigError

# ds_plugins: initialize(training_data=...) (trainguard's loader); ds_plugins/framework: the zero-code
# entry under HF Trainer / Accelerate (their loader, tagged: ds_plugins/loaders.py); ds_plugins/own:
# initialize without training_data (your loader, which trainguard never sees)
ADAPTERS = ("ds_plugins", "ds_plugins/framework", "ds_plugins/own", "megatron_hooks")

_YOUR_LOADER = ("the data loader is yours (Megatron-LM's or your loop's), so trainguard never sees the samples; "
                "check them in your dataset")
_GROUPS_EXIST = ("the process groups exist before install() (Megatron-LM and your script create them); set the "
                 "timeout where they are created (Megatron-LM: --distributed-timeout-minutes)")


@dataclass(frozen=True)
class Refusal:
    reason: str
    inert: tuple = ()  # values that do nothing, hence accepted (e.g. 0 batches to skip)


# key path (without "trainguard.") -> adapter -> why it is refused there. A path ending in "." covers
# every key under it; "faults[].type" is checked per fault.
_DATA = Refusal("shuffling, drop_last and the data position apply to the loader ds_plugins.initialize builds "
                "(pass training_data to it)")
_SKIP = Refusal("the loader is not trainguard's: a rollback cannot move it past the bad batches (it continues "
                "past the batches already seen); set 0", inert=(0,))
_OWN = ("your loader is not trainguard's, so trainguard never sees the samples: pass training_data to "
        "ds_plugins.initialize, or check them in your dataset")

REFUSED: dict[str, dict[str, Refusal]] = {
    "sanitize.enabled": {"megatron_hooks": Refusal(_YOUR_LOADER, inert=(False,)),
                         "ds_plugins/own": Refusal(_OWN, inert=(False,))},
    "sanitize.": {"megatron_hooks": Refusal(_YOUR_LOADER, inert=(None,)), "ds_plugins/own": Refusal(_OWN, inert=(None,))},
    "data.": {"megatron_hooks": _DATA, "ds_plugins/framework": _DATA, "ds_plugins/own": _DATA},
    "distributed.collective_timeout_s": {"megatron_hooks": Refusal(_GROUPS_EXIST, inert=(None,))},
    "distributed.fresh_store_per_attempt": {"megatron_hooks": Refusal(
        "the default process group exists before install(): its store cannot be chosen any more (launch under "
        "`trainguard run --`: a restarted attempt's init_process_group then gets a store of its own)", inert=(False,))},
    "recovery.skip_batches": {"megatron_hooks": Refusal(
        "your data iterator cannot be moved by a rollback (it continues past the batches already seen); set 0",
        inert=(0,)), "ds_plugins/framework": _SKIP, "ds_plugins/own": _SKIP},
    "checkpoint.snapshot.every_steps": {"ds_plugins/framework": Refusal(
        "Hugging Face's Trainer and Accelerate resume from their own checkpoint-N folders (their trainer state, "
        "scheduler and data position), which a shard in memory cannot stand in for", inert=(0,))},
    "checkpoint.async": {"megatron_hooks": Refusal(
        "snapshots are written synchronously (dist_checkpointing's async writer is not under the commit protocol "
        "yet)", inert=(False,))},
    "clipping.mode": {"megatron_hooks": Refusal(
        "clipping by value clamps each local gradient in a hook, and megatron's gradients there carry the loss scale "
        "divided by your number of micro-batches, which the guard does not know; use norm or adaptive",
        inert=("deepspeed", "norm", "adaptive"))},
    "clipping.value": {"megatron_hooks": Refusal("only used by clipping.mode \"value\" (refused on megatron)")},
    "checks.min_warmup_steps": {"megatron_hooks": Refusal(
        "the LR schedule is yours (Megatron-LM's OptimizerParamScheduler): megatron_hooks cannot read its warmup")},
    "faults[].type": {"megatron_hooks": Refusal(
        "bad_label needs the loader of ds_plugins; on megatron use nan_batch (with sample: one bad sample), nan_loss, "
        "inf_activation or inf_grad", inert=("nan_loss", "inf_grad", "spike_batch", "lr_ramp", "inf_activation",
                                              "nan_batch", "attention_collapse", "kill_rank", "hang_rank", "corrupt_checkpoint",
                                              "fp16_overflow", "slow_rank", "nan_weights", "bitflip",
                                              "sdc_compute"))},
}


def _unwrap(annotation: Any) -> Any:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (list, typing.Union, getattr(__import__("types"), "UnionType", None)) and args:
        return _unwrap(args[0])
    return annotation


def leaf_keys(model: type[BaseModel] | None = None, prefix: str = "") -> list[str]:
    """Every leaf key of the block, as ``section.key`` (list items as ``faults[].type``)."""
    if model is None:
        from trainguard.config import TrainguardConfig

        model = TrainguardConfig
    out = []
    for name, field in model.model_fields.items():
        key = field.alias or name
        inner = _unwrap(field.annotation)
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            sub = f"{prefix}{key}[]." if typing.get_origin(field.annotation) is list else f"{prefix}{key}."
            out += leaf_keys(inner, sub)
        else:
            out.append(f"{prefix}{key}")
    return out


def refusal(key: str, adapter: str) -> Refusal | None:
    for path, per_adapter in REFUSED.items():
        if (key == path or (path.endswith(".") and key.startswith(path))) and adapter in per_adapter:
            return per_adapter[adapter]
    return None


def adapters_for(key: str) -> list[str]:
    """The adapters that honour ``key`` (for the reference's column)."""
    return [a for a in ADAPTERS if refusal(key, a) is None or refusal(key, a).inert]


def _set_values(model: BaseModel, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """The leaf keys the user set explicitly, with their values."""
    for name in sorted(model.model_fields_set):
        field = type(model).model_fields[name]
        key = field.alias or name
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            yield from _set_values(value, f"{prefix}{key}.")
        elif isinstance(value, list) and value and all(isinstance(v, BaseModel) for v in value):
            for item in value:
                yield from _set_values(item, f"{prefix}{key}[].")
        else:
            yield f"{prefix}{key}", value


def check_supported(cfg, adapter: str) -> None:
    """Raise ConfigError naming every key the user set that ``adapter`` cannot honour, and why."""
    problems = []
    for key, value in _set_values(cfg):
        r = refusal(key, adapter)
        if r is None or any(value == v and type(value) is type(v) for v in r.inert):
            continue
        problems.append((f"trainguard.{key}", f"{value!r} is not applied by {adapter} ({r.reason})"))
    if problems:
        raise ConfigError(problems)


def check_release(cfg, package: str, version: str) -> None:
    """Raise ConfigError naming every key the user set that cannot run on this release of ``package`` (the
    support matrix's per-series refusals, trainguard/releases.json), and why."""
    from trainguard import releases

    refused = releases.refused_keys(package, version)
    problems = [(f"trainguard.{key}", f"{value!r} cannot run on {releases.package(package).name} {version} ({why})")
                for key, value in _set_values(cfg) for path, why in refused.items()
                if key == path or (path.endswith(".") and key.startswith(path))]
    if problems:
        raise ConfigError(problems)
