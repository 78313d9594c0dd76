"""What ``trainguard run`` checks before it launches anything: every trainguard block the command names.

A bad block used to surface ~20 s after the launch, inside every rank's traceback (after Megatron-LM's ~700 lines of
argparse usage); a callback that cannot be imported only when the guard was built. Here, before the command runs,
once per job: the JSON files the command line names (``--deepspeed ds.json``, ``--deepspeed_config=ds.json``,
``--trainguard-config tg.json``, any argument ending in ``.json`` that is a file) are read; each one holding a
trainguard block -- or a top-level key one edit away from it -- is parsed as the ranks will parse it, and the
modules of the callbacks, custom detectors and sinks it names are found on the path (not run: issue 25). A file that is not a ds_config (a tokenizer's
vocabulary, a dataset index) is left alone: only a file with the block, or its typo, is judged.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from trainguard.config import BLOCK, load
from trainguard.config.parsing import misspelt_block
from trainguard.errors import ConfigError


def named_files(command: Iterable[str]) -> list[Path]:
    """The ``.json`` files the command line names (as an argument or an ``--option=value``), existing, in order."""
    seen: list[Path] = []
    for arg in command:
        value = arg.split("=", 1)[1] if arg.startswith("-") and "=" in arg else arg
        if value.endswith(".json"):
            p = Path(value)
            if p.is_file() and p not in seen:
                seen.append(p)
    return seen


def _holds_a_block(path: Path) -> bool:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return False  # (not a ds_config: not ours to judge -- the framework reads it, or does not)
    return isinstance(data, dict) and (BLOCK in data or misspelt_block(data) is not None)


def findable(spec: str, key: str) -> None:
    """The module of ``"package.module:name"`` found on the path without running any of it (a block's extensions are
    code: validating must not execute them -- issue 25); a ConfigError naming ``key`` otherwise."""
    import importlib.machinery
    import sys

    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ConfigError([(key, f"{spec!r} is neither a registered name nor of the form 'package.module:name'")])
    parts, search, name = module.split("."), None, ""
    for part in parts:
        name = f"{name}.{part}" if name else part
        found = sys.modules.get(name)
        spec_ = getattr(found, "__spec__", None) if found is not None else \
            importlib.machinery.PathFinder.find_spec(name, search)
        if spec_ is None:
            raise ConfigError([(key, f"cannot import {module!r}: no module {name!r} on the Python path of this "
                                     "launch")])
        search = spec_.submodule_search_locations


def check_imports(block) -> None:
    """Find every callback, custom detector and sink module the block names (a ConfigError naming each key that
    fails), without importing them."""
    from trainguard.plugins import DETECTORS, SINKS

    problems = []
    named = [(f"trainguard.callbacks[{i}]", spec, {}) for i, spec in enumerate(block.callbacks)]
    named += [(f"trainguard.detectors.custom[{i}].type", s.type, DETECTORS)
              for i, s in enumerate(block.detectors.custom)]
    named += [(f"trainguard.metrics.sinks[{i}].type", s.type, SINKS) for i, s in enumerate(block.metrics.sinks)]
    for key, spec, registry in named:
        if spec in registry:
            continue
        try:
            findable(spec, key)
        except ConfigError as e:
            problems += e.problems
    if problems:
        raise ConfigError(problems)


def check(path: Path):
    """The block of ``path`` parsed and its extensions imported (None: the file has no block); ConfigError else."""
    _, block = load(path)
    if block is not None:
        try:
            check_imports(block)
        except ConfigError as e:
            raise ConfigError(e.problems, str(path)) from None
    return block


def check_command(command: Iterable[str]) -> list[tuple[Path, object]]:
    """Every block the command names, checked: ``[(file, block)]``; the first ConfigError raised as it is."""
    return [(p, check(p)) for p in named_files(command) if _holds_a_block(p)]
