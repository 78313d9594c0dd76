"""Which adapter honours which key of the block: each adapter's declaration (its ``capabilities`` module, found
through an entry point), read here for the check at start and for the config reference's per-adapter column.

Every leaf key is honoured by every adapter unless its declaration refuses it. A key
an adapter cannot honour is refused *when the user set it* (to a value that would do something):
``install``/``initialize`` raise :class:`ConfigError` naming the key, the adapter and why -- a key
that is set and silently does nothing would lie to the user. Defaults are never refused.
"""
from __future__ import annotations

import functools
import sys
import typing
from dataclasses import dataclass
from typing import Any, Iterator

from pydantic import BaseModel

from trainguard.config.problems import unwrap
from trainguard.errors import ConfigError

GROUP = "trainguard.adapters"  # the entry points naming each installed adapter's declaration (setup.py)


# What an adapter may advise in the core's records and errors, declared beside its refusals (``HINTS`` in its
# capabilities module, handed to GuardSession(hints=...)): each a fragment the core appends to its own sentence --
# a verdict that names no sample, a replay key set where the adapter was given no replay, a batch the sanitiser
# emptied on a framework's loader
HINT_KEYS = ("sample_ids", "replay", "refill")


def check_hints(hints: dict | None) -> dict:
    """An adapter's ``HINTS``, their keys checked (a misspelt key would silently fall back to the core's words)."""
    unknown = sorted(set(hints or {}) - set(HINT_KEYS))
    if unknown:
        raise ValueError(f"hints {unknown}: the core reads only {list(HINT_KEYS)}")
    return dict(hints or {})


@dataclass(frozen=True)
class Refusal:
    reason: str
    inert: tuple = ()  # values that do nothing, hence accepted (e.g. 0 batches to skip)


@functools.cache
def declared() -> dict[str, dict[str, Refusal]]:
    """Every installed adapter's declaration, by the name it runs under: {adapter: {key path: Refusal}}. An adapter
    declares itself once, in a module its entry point (group :data:`GROUP`) names: ``VARIANTS`` (the names it runs
    under) and ``REFUSED`` ({key path: {variant: Refusal}}; a path ending in "." covers every key under it, and
    "faults[].type" is checked per fault). The core names no adapter: this is how it learns of them."""
    out: dict[str, dict[str, Refusal]] = {}
    for mod in _declarations():
        for variant in mod.VARIANTS:
            out[variant] = {path: per[variant] for path, per in mod.REFUSED.items() if variant in per}
    return out


def adapters() -> tuple[str, ...]:
    return tuple(declared())


@functools.cache
def launched_by() -> dict[str, str]:
    """The launch-line flags with which an installed adapter's framework takes the file of a trainguard block
    ({flag: the variant it runs under}: its declaration's optional ``LAUNCH_FLAGS``): ``trainguard run`` checks such
    a file against what that variant refuses, before anything is launched."""
    out: dict[str, str] = {}
    for mod in _declarations():
        out.update(getattr(mod, "LAUNCH_FLAGS", {}))
    return out


@functools.cache
def _declarations() -> tuple:
    """The installed adapters' declaration modules, in their entry points' name order (group :data:`GROUP`)."""
    from importlib.metadata import entry_points

    return tuple(ep.load() for ep in sorted(entry_points(group=GROUP), key=lambda e: e.name))


def leaf_keys(model: type[BaseModel] | None = None, prefix: str = "") -> list[str]:
    """Every leaf key of the block, as ``section.key`` (list items as ``faults[].type``)."""
    if model is None:
        from trainguard.config import TrainguardConfig

        model = TrainguardConfig
    out = []
    for name, field in model.model_fields.items():
        key = field.alias or name
        inner = unwrap(field.annotation)
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            sub = f"{prefix}{key}[]." if typing.get_origin(field.annotation) is list else f"{prefix}{key}."
            out += leaf_keys(inner, sub)
        else:
            out.append(f"{prefix}{key}")
    return out


def refusal(key: str, adapter: str, table: dict[str, Refusal] | None = None) -> Refusal | None:
    """Why ``adapter`` refuses ``key`` (from ``table``, its declaration: by default the installed one), or None."""
    for path, why in (declared().get(adapter, {}) if table is None else table).items():
        if key == path or (path.endswith(".") and key.startswith(path)):
            return why
    return None


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


def table_of(refused: dict[str, dict[str, Refusal]], variant: str) -> dict[str, Refusal]:
    """One variant's refusals from an adapter's ``REFUSED`` declaration."""
    return {path: per[variant] for path, per in refused.items() if variant in per}


def check_supported(cfg, adapter: str, refused: dict[str, dict[str, Refusal]] | None = None) -> None:
    """Raise ConfigError naming every key the user set that ``adapter`` cannot honour, and why. ``refused``: the
    adapter's own declaration (its ``REFUSED``; default: the installed adapters')."""
    problems = []
    table = table_of(refused, adapter) if refused is not None else None
    for key, value in _set_values(cfg):
        r = refusal(key, adapter, table)
        if r is None or any(value == v and type(value) is type(v) for v in r.inert):
            continue
        problems.append((f"trainguard.{key}", f"{value!r} is not applied by {adapter} ({r.reason})"))
    if problems:
        raise ConfigError(problems)


def refusals(cfg) -> dict[str, list[str]]:
    """Under each installed adapter (the names it runs under), the keys the block sets that it would refuse at start,
    each with why: what ``trainguard validate`` says before a launch."""
    out = {}
    for adapter in adapters():
        try:
            check_supported(cfg, adapter)
        except ConfigError as e:
            out[adapter] = [f"{key}: {why}" for key, why in e.problems]
    return out


def check_release(cfg, package: str, version: str) -> None:
    """Raise ConfigError naming every key the user set that cannot run on this release of ``package`` (the
    support matrix's per-series refusals, trainguard/support/releases.json), and why."""
    from trainguard.support import releases

    refused = releases.refused_keys(package, version)
    problems = [(f"trainguard.{key}", f"{value!r} cannot run on {releases.package(package).name} {version} ({why})")
                for key, value in _set_values(cfg) for path, why in refused.items()
                if key == path or (path.endswith(".") and key.startswith(path))]
    if problems:
        raise ConfigError(problems)


def refuse_flags(cfg, args, flags, source: str, framework: str) -> None:
    """At the framework's argument parsing, before any process group: a flag of the adapter's declaration (``flags``:
    ``(flag, conflicts(args, cfg), why, instead)``) that conflicts with the block stops the launch -- exit 2, as a
    bad key does -- naming the flag, why and what to use instead."""
    for flag, conflicts, why, instead in flags:
        if conflicts(args, cfg):
            print(f"error: {source} cannot run with {framework}'s {flag}: {why}. Instead: {instead}.", file=sys.stderr,
                  flush=True)
            raise SystemExit(2)
