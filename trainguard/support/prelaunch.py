"""What ``trainguard run`` checks before it launches anything: every trainguard block the command names.

A bad block used to surface ~20 s after the launch, inside every rank's traceback (after Megatron-LM's ~700 lines of
argparse usage); a callback that cannot be imported only when the guard was built. Here, before the command runs,
once per job: the JSON files the command line names (``--deepspeed ds.json``, ``--deepspeed_config=ds.json``,
``--trainguard-config tg.json``, any argument ending in ``.json`` that is a file) are read; each one holding a
trainguard block -- or a top-level key one edit away from it -- is parsed as the ranks will parse it (a file
``--trainguard-config`` names with what the adapter whose framework takes that flag refuses), and the
modules of the callbacks, custom detectors and sinks it names are found on the path (not run). A file that is not a ds_config (a tokenizer's
vocabulary, a dataset index) is left alone: only a file with the block, or its typo, is judged.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from trainguard.config import BLOCK, load
from trainguard.config.parsing import misspelt_block
from trainguard.errors import ConfigError


OURS = ("--trainguard-config",)  # the block alone, or a ds_config-style file (megatron_hooks/args.py, supervise)
CONFIG_FLAGS = ("--deepspeed", "--deepspeed_config", "--deepspeed-config", "--deepspeed_config_file", *OURS)
ACCELERATE_FLAGS = ("--config_file", "--config-file")  # (accelerate launch's YAML, which names the ds_config)
UNNAMED_MAX = 1 << 20  # a .json argument no config flag names, larger than this, is data (a dataset), not read


def named_files(command: Iterable[str]) -> list[tuple[Path, bool]]:
    """The ``.json`` files the command line names (an argument, ``--option value`` or ``--option=value``), existing,
    in order, each with whether ``--trainguard-config`` names it (then it may hold the block alone)."""
    seen: list[tuple[Path, bool]] = []
    previous = ""
    for arg in command:
        flag, value = (arg.split("=", 1) if arg.startswith("-") and "=" in arg else (previous, arg))
        previous = arg
        if not value.endswith(".json"):
            continue
        p = Path(value)
        named = flag in CONFIG_FLAGS
        if p.is_file() and p not in [q for q, _ in seen] and (named or p.stat().st_size <= UNNAMED_MAX):
            seen.append((p, flag in OURS))
    return seen


def accelerate_files(command: list[str]) -> list[tuple[Path, bool]]:
    """The ds_config an ``accelerate launch`` line's YAML names (``--config_file``, else Accelerate's default config
    file): ``deepspeed_config.deepspeed_config_file``, as Accelerate reads it (relative to the working directory)."""
    import os

    if not command or Path(command[0]).name != "accelerate" or command[1:2] != ["launch"]:
        return []
    script = next((i for i, a in enumerate(command) if a.endswith(".py") or a == "-m"), len(command))
    own = command[:script]  # (a --config_file after the script is the script's own argument)
    given = [v for f, v in zip(own, own[1:]) if f in ACCELERATE_FLAGS] + \
        [a.split("=", 1)[1] for a in own if a.split("=", 1)[0] in ACCELERATE_FLAGS and "=" in a]
    cache = os.environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))
    home = os.path.expanduser(os.environ.get("HF_HOME", os.path.join(cache, "huggingface")))
    yaml_path = Path(given[0] if given else os.path.join(home, "accelerate", "default_config.yaml"))
    try:
        import yaml  # (Accelerate's own dependency)
    except ImportError:
        return []
    try:
        named = (yaml.safe_load(yaml_path.read_text(encoding="utf-8")) or {}).get("deepspeed_config", {})
        ds = Path(named.get("deepspeed_config_file") or "")
    except (OSError, ValueError, AttributeError, TypeError, yaml.YAMLError):
        return []  # (no YAML to read, or not Accelerate's: the ranks read what they read)
    return [(ds, False)] if ds.suffix == ".json" and ds.is_file() else []


def _holds_a_block(path: Path, alone: bool) -> bool:
    if alone:
        return True  # (--trainguard-config: the block itself, or a file holding it -- judged whatever it holds)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return False  # (not a ds_config: not ours to judge -- the framework reads it, or does not)
    return isinstance(data, dict) and (BLOCK in data or misspelt_block(data) is not None)


def _search_path(command: Iterable[str]) -> list[str]:
    """Where the launched script will import from, beside this process's path: the working directory and each
    ``.py`` argument's folder (``python train.py`` puts its folder first; ``-m pkg.mod`` the working directory)."""
    import os
    import sys

    extra = [os.getcwd()] + [str(Path(a).resolve().parent) for a in command if a.endswith(".py")]
    return list(dict.fromkeys(extra + [p or os.getcwd() for p in sys.path]))


def findable(spec: str, key: str, path: list[str] | None = None) -> None:
    """The module of ``"package.module:name"`` found on the path without running any of it (a block's extensions are
    code: validating must not execute them); a ConfigError naming ``key`` otherwise."""
    import importlib.machinery
    import sys

    from trainguard.plugins import split_spec

    module, _ = split_spec(spec, key)
    parts, search, name = module.split("."), path, ""
    for part in parts:
        name = f"{name}.{part}" if name else part
        found = sys.modules.get(name)
        spec_ = getattr(found, "__spec__", None) if found is not None else \
            importlib.machinery.PathFinder.find_spec(name, search)
        if spec_ is None:
            raise ConfigError([(key, f"cannot import {module!r}: no module {name!r} on the Python path of this "
                                     "launch")])
        search = spec_.submodule_search_locations


def check_imports(block, path: list[str] | None = None, source: str | None = None) -> None:
    """Find every callback, custom detector and sink module the block names (a ConfigError naming each key that
    fails, and ``source``, the file), without importing them. ``path``: where to look (None: ``sys.path``)."""
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
            findable(spec, key, path)
        except ConfigError as e:
            problems += e.problems
    if problems:
        raise ConfigError(problems, source)


def check(path: Path, alone: bool = False, search: list[str] | None = None):
    """The block of ``path`` parsed (``alone``: it may be the block itself, as ``--trainguard-config`` takes it) and
    its extensions found (None: the file has no block); ConfigError else."""
    if alone:
        from trainguard.config.parsing import block_of

        try:
            block = block_of(path)
        except TypeError as e:  # (JSON, but not an object)
            raise ConfigError([("<file>", str(e))], str(path)) from None
    else:
        _, block = load(path)
    if block is not None:
        check_imports(block, search, str(path))
        # (a flag an adapter's framework takes the block with -- Megatron-LM's --trainguard-config: what that adapter
        # refuses stops the launch now, not every rank after it -- a new user's job launched, then died at parsing)
        from trainguard.support.support import check_supported, launched_by

        for variant in {launched_by()[f] for f in OURS if f in launched_by()} if alone else ():
            try:
                check_supported(block, variant)
            except ConfigError as e:
                raise ConfigError(e.problems, str(path)) from None
    return block


def check_command(command: Iterable[str]) -> list[tuple[Path, object]]:
    """Every block the command names, checked: ``[(file, block)]``; the first ConfigError raised as it is."""
    command = list(command)
    search = _search_path(command)
    files = named_files(command)
    files += [f for f in accelerate_files(command) if f[0] not in [p for p, _ in files]]
    return [(p, check(p, alone, search)) for p, alone in files if _holds_a_block(p, alone)]
