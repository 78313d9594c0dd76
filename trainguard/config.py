"""The typed "trainguard" block, parsed once where the JSON enters.

The block lives in the same ds_config that DeepSpeed reads (DeepSpeed ignores unknown top-level
blocks and stores them in its checkpoints). Everything downstream receives these frozen models,
never the raw dict. Unknown keys are errors naming the full path with a did-you-mean; every
problem is collected into one :class:`ConfigError`.

The JSON Schema (``configs/trainguard.schema.json``) and the reference page
(``docs/config-reference.md``) are generated from these models: ``python -m trainguard.config``.
"""
from __future__ import annotations

import difflib
import json
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from trainguard.errors import ConfigError

BLOCK = "trainguard"
FAULTS_REFUSED = ("faults are listed but 'allow_faults' is not true; fault injection is refused in a "
                  "config that does not opt in")
FAULT_TYPES = ("nan_loss", "inf_grad", "nan_batch")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NonfiniteConfig(_Section):
    """Non-finite loss and gradients, checked on each rank's local values."""

    enabled: bool = Field(True, description="Check every step's local loss and local gradients for NaN/Inf.")
    check_grads: bool = Field(
        True,
        description="Also check gradients (a tensor hook per parameter, before the data-parallel "
        "reduction). Off: only the loss is checked.")
    action: Literal["skip_step", "abort"] = Field(
        "skip_step",
        description="What every rank does when any rank's values are non-finite: skip the optimizer "
        "step on all ranks, or stop the run on all ranks with a report.")
    max_consecutive: int = Field(
        20, ge=1,
        description="Abort (with a report) after this many non-finite steps in a row: a run that "
        "never recovers should not skip forever.")


class DetectorsConfig(_Section):
    nonfinite: NonfiniteConfig = Field(default_factory=NonfiniteConfig)


class MetricsConfig(_Section):
    """The JSONL event log, the run's source of truth."""

    jsonl: Optional[str] = Field(
        "trainguard.jsonl",
        description="Event and metric log written by rank 0 (one JSON object per line). null: none.")
    per_rank: bool = Field(
        False, description="Also write one file per rank (`<stem>.rank<r>.jsonl`) with its local values.")
    every_steps: int = Field(1, ge=1, description="Write a metric line every N optimizer steps (events always).")


class DataConfig(_Section):
    """The loader handed back when ``training_data`` is given."""

    shuffle: bool = Field(True, description="Shuffle each epoch (a permutation seeded by seed + epoch).")
    seed: int = Field(0, description="Seed of the per-epoch permutation; identical on every rank.")
    drop_last: bool = Field(
        True, description="Drop the tail that does not fill a micro-batch on every data-parallel rank.")


class FaultSpec(_Section):
    """One injected fault. Used by tests, the demo and fire drills; refused unless allow_faults."""

    type: Literal["nan_loss", "inf_grad", "nan_batch"] = Field(
        description="nan_loss: the loss passed to backward becomes NaN. inf_grad: one parameter's "
        "local gradient gets +Inf. nan_batch: the batch's floating-point tensors become NaN (an "
        "integer-only batch poisons the output of the model's first leaf module instead).")
    step: int = Field(ge=1, description="Optimizer step (1-based, as logged) at which the fault fires.")
    rank: int = Field(0, ge=0, description="Global rank on which the fault fires.")
    param: Optional[str] = Field(
        None, description="inf_grad only: parameter name (as in model.named_parameters()); default the first.")

    @model_validator(mode="after")
    def _param_only_for_inf_grad(self):
        if self.param is not None and self.type != "inf_grad":
            raise ValueError(f"'param' applies only to type 'inf_grad', not '{self.type}'")
        return self


class TrainguardConfig(_Section):
    """The whole block. Defaults are the ones to run production with."""

    enabled: bool = Field(True, description="false: DeepSpeed's own behaviour, unchanged.")
    detectors: DetectorsConfig = Field(default_factory=DetectorsConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    allow_faults: bool = Field(
        False, description="Must be true for 'faults' to be accepted, so that a production config "
        "cannot carry one by accident.")
    faults: list[FaultSpec] = Field(default_factory=list, description="Faults to inject (testing only).")

    @model_validator(mode="after")
    def _faults_need_permission(self):
        if self.faults and not self.allow_faults:
            raise ValueError(FAULTS_REFUSED)
        return self


# --------------------------------------------------------------------------- parsing


def _unwrap(annotation: Any) -> Any:
    """Optional[X] -> X, list[X] -> X (enough to walk our own models)."""
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _unwrap(args[0]) if len(args) == 1 else annotation
    if origin in (list, tuple):
        return _unwrap(typing.get_args(annotation)[0])
    return annotation


def _model_at(loc: tuple) -> type[BaseModel] | None:
    model: Any = TrainguardConfig
    for part in loc:
        if isinstance(part, int):
            continue
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return None
        model = _unwrap(model.model_fields[part].annotation)
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _path(loc: tuple) -> str:
    out = BLOCK
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def _edit_distance(a: str, b: str) -> int:
    """Optimal-string-alignment distance: a swap of two neighbours ('stpe' -> 'step') costs 1."""
    d = [[max(i, j) if min(i, j) == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            cost = a[i - 1] != b[j - 1]
            d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                d[i][j] = min(d[i][j], d[i - 2][j - 2] + 1)
    return d[len(a)][len(b)]


def _closest(name: str, known: list[str]) -> str | None:
    scored = sorted((_edit_distance(name.lower(), k), k) for k in known)
    if scored and scored[0][0] <= max(2, len(name) // 3):
        return scored[0][1]
    close = difflib.get_close_matches(name, known, n=1)  # longer keys with a prefix/suffix typo
    return close[0] if close else None


def _problems(err: ValidationError) -> list[tuple[str, str]]:
    problems = []
    for e in err.errors(include_url=False):
        loc = tuple(e["loc"])
        if e["type"] == "extra_forbidden":
            model = _model_at(loc[:-1])
            known = sorted(model.model_fields) if model else []
            guess = _closest(str(loc[-1]), known)
            hint = f"; did you mean '{guess}'?" if guess else ""
            problems.append((_path(loc), f"unknown key{hint} (known: {', '.join(known)})"))
            continue
        msg = e["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        if msg == FAULTS_REFUSED:
            loc = ("faults",)
        if e["type"] not in ("missing", "value_error") and "input" in e:
            msg += f" (got {json.dumps(e['input'], default=str)})"
        problems.append((_path(loc), msg))
    return problems


def parse_block(block: Any, source: str | None = None) -> TrainguardConfig:
    """Validate the "trainguard" block itself (the dict under the key)."""
    if not isinstance(block, dict):
        raise ConfigError([(BLOCK, f"must be a JSON object (got {type(block).__name__})")], source)
    try:
        return TrainguardConfig.model_validate(block)
    except ValidationError as err:
        problems = _problems(err)
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
    try:
        data = json.loads(text, object_pairs_hook=_reject_duplicates)
    except json.JSONDecodeError as e:
        raise ConfigError([("<file>", f"not valid JSON at line {e.lineno} column {e.colno}: {e.msg}")],
                          str(p)) from None
    except ValueError as e:
        raise ConfigError([("<file>", str(e))], str(p)) from None
    if not isinstance(data, dict):
        raise ConfigError([("<file>", "the top level must be a JSON object (a ds_config)")], str(p))
    return data


def load(config: str | os.PathLike | dict | None) -> tuple[dict | None, TrainguardConfig | None]:
    """Resolve a ds_config (path or dict) into ``(ds_config_dict, block_or_None)``.

    ``None`` for the block means the config has no "trainguard" key: the caller should behave
    exactly as plain DeepSpeed.
    """
    if config is None:
        return None, None
    source = None
    if isinstance(config, (str, os.PathLike)):
        source = str(config)
        config = read_json(config)
    if not isinstance(config, dict):
        raise ConfigError([("<config>", f"expected a path or a dict, got {type(config).__name__}")])
    if BLOCK not in config:
        return config, None
    return config, parse_block(config[BLOCK], source)


# --------------------------------------------------------------------------- generated docs


def json_schema() -> dict:
    schema = TrainguardConfig.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "trainguard block of ds_config.json"
    return schema


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return " \\| ".join(f"`{json.dumps(a)}`" for a in typing.get_args(annotation))
    if origin in (Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is list:
        return f"list of {_type_name(typing.get_args(annotation)[0])}"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation)).replace("Config", "").replace("Spec", "")


def _rows(model: type[BaseModel], prefix: str, out: list[str], nested: list):
    for name, field in model.model_fields.items():
        path = f"{prefix}.{name}"
        inner = _unwrap(field.annotation)
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            if typing.get_origin(field.annotation) is list:
                nested.append((inner, f"{path}[]"))
                out.append(f"| `{path}` | list of objects | `[]` | {field.description or ''} See below. |")
            else:
                nested.append((inner, path))
            continue
        if field.is_required():
            default = "required"
        else:
            default = f"`{json.dumps(field.get_default(call_default_factory=True))}`"
        bounds = [f"{m.__class__.__name__.lower()} {getattr(m, m.__class__.__name__.lower(), '')}"
                  for m in field.metadata if m.__class__.__name__ in ("Ge", "Gt", "Le", "Lt")]
        bound = f" ({', '.join(bounds)})" if bounds else ""
        out.append(f"| `{path}` | {_type_name(field.annotation)}{bound} | {default} | "
                   f"{field.description or ''} |")


def reference_markdown() -> str:
    out = ["# Config reference: the `trainguard` block", "",
           "Generated from `trainguard/config.py` by `python -m trainguard.config`; a test keeps it "
           "in sync. Unknown keys are errors. Every key is optional unless marked required.", ""]
    queue = [(TrainguardConfig, BLOCK)]
    while queue:
        model, prefix = queue.pop(0)
        out += [f"## `{prefix}`", ""]
        doc = (model.__doc__ or "").strip().splitlines()
        if doc:
            out += [doc[0], ""]
        rows: list[str] = []
        nested: list = []
        _rows(model, prefix, rows, nested)
        if rows:
            out += ["| key | type | default | meaning |", "|---|---|---|---|", *rows, ""]
        else:
            out += ["Sections: " + ", ".join(f"`{p}`" for _, p in nested) + ".", ""]
        queue = nested + queue
    return "\n".join(out).rstrip() + "\n"


def write_generated(root: str | os.PathLike) -> list[Path]:
    root = Path(root)
    schema_path = root / "configs" / "trainguard.schema.json"
    ref_path = root / "docs" / "config-reference.md"
    schema_path.write_text(json.dumps(json_schema(), indent=2, sort_keys=True) + "\n", encoding="utf-8")
    ref_path.write_text(reference_markdown(), encoding="utf-8")
    return [schema_path, ref_path]


if __name__ == "__main__":  # python -m trainguard.config [REPO_ROOT]
    import sys

    for p in write_generated(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]):
        print(f"wrote {p}")
