"""The block parsed where the JSON enters (trainguard.config): a ds_config file or dict read, the block validated
into one :class:`ConfigError` naming every problem, and its fingerprint."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from trainguard.config.block import BLOCK, TrainguardConfig
from trainguard.config.faults import FAULTS_REFUSED
from trainguard.config.problems import told
from trainguard.errors import ConfigError


def parse_block(block: Any, source: str | None = None) -> TrainguardConfig:
    """Validate the "trainguard" block itself (the dict under the key)."""
    if not isinstance(block, dict):
        raise ConfigError([(BLOCK, f"must be a JSON object (got {type(block).__name__})")], source)
    try:
        return TrainguardConfig.model_validate(block)
    except ValidationError as err:
        problems = told(err, TrainguardConfig, BLOCK, FAULTS_REFUSED)
        # pydantic skips model-level checks when a field failed; still report this one now
        if block.get("faults") and block.get("allow_faults") is not True and \
                not any(msg == FAULTS_REFUSED for _, msg in problems):
            problems.append((f"{BLOCK}.faults", FAULTS_REFUSED))
        raise ConfigError(problems, source) from None


def _reject_duplicates(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key '{k}'")
        out[k] = v
    return out


def read_json(path: str | os.PathLike) -> dict:
    """Read a ds_config file; errors name the file and the position."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError([("<file>", f"cannot read {p}: {e.strerror}")], str(p)) from None
    except UnicodeDecodeError as e:
        raise ConfigError([("<file>", f"not UTF-8 text (byte {e.start}): a JSON file is UTF-8")], str(p)) from None
    try:
        data = json.loads(text, object_pairs_hook=_reject_duplicates)
    except json.JSONDecodeError as e:
        raise ConfigError([("<file>", f"not valid JSON at line {e.lineno} column {e.colno}: {e.msg}")],
                          str(p)) from None
    except ValueError as e:
        raise ConfigError([("<file>", str(e))], str(p)) from None
    except RecursionError:
        raise ConfigError([("<file>", "nested too deeply to be a ds_config")], str(p)) from None
    if not isinstance(data, dict):
        raise ConfigError([("<file>", "the top level must be a JSON object (a ds_config)")], str(p))
    return data


def load(config: str | os.PathLike | dict | None,
         source: str | None = None) -> tuple[dict | None, TrainguardConfig | None]:
    """Resolve a ds_config (path or dict) into ``(ds_config_dict, block_or_None)``. ``source``: the file a dict was
    read from, for the errors to name (HF's Trainer reads the user's file and hands on the dict).

    ``None`` for the block means the config has no "trainguard" key: the caller should behave
    exactly as plain DeepSpeed.
    """
    if config is None:
        return None, None
    if isinstance(config, (str, os.PathLike)):
        source = str(config)
        config = read_json(config)
    if not isinstance(config, dict):
        raise ConfigError([("<config>", f"expected a path or a dict, got {type(config).__name__}")])
    if BLOCK not in config:
        near = misspelt_block(config)
        if near is not None:  # (a typo would train unguarded, silently: the user asked for a guard)
            raise ConfigError([(near, f"a typo of \"{BLOCK}\"? did you mean \"{BLOCK}\" (as it is, the run would "
                                      f"train unguarded; to switch the guard off, keep the block with \"enabled\": "
                                      "false)")], source)
        return config, None
    return config, parse_block(config[BLOCK], source)


def misspelt_block(config: dict) -> str | None:
    """A top-level key that is "trainguard" mistyped (case, or one or two edits), else None."""
    import difflib

    for key in config:
        if isinstance(key, str) and key != BLOCK and (key.lower() == BLOCK or
                                                      difflib.SequenceMatcher(None, key.lower(), BLOCK).ratio() >= 0.85):
            return key
    return None


def block_of(config: Any, caller: str = "trainguard") -> TrainguardConfig:
    """The block, for an API that takes it alone (megatron_hooks.install): a parsed config, a dict, or a JSON
    file -- the block itself, or a ds_config-style one holding a "trainguard" key."""
    if isinstance(config, TrainguardConfig):
        return config
    source = None
    if isinstance(config, (str, os.PathLike)):
        source, config = str(config), read_json(config)
    if not isinstance(config, dict):
        raise TypeError(f"{caller}: config must be a path, a dict or a TrainguardConfig, not {type(config).__name__}")
    return parse_block(config.get(BLOCK, config), source)


def config_hash(cfg: TrainguardConfig) -> str:
    """The block's fingerprint (a checkpoint's lineage, the run_start record): sha256 of its canonical JSON, 16 hex."""
    import hashlib

    text = json.dumps(cfg.model_dump(mode="json"), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
