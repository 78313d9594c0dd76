"""The config's generated documents: the JSON schema (configs/trainguard.schema.json) and the reference
(docs/config-reference.md), from the models in trainguard.config and the installed adapters' declarations
(trainguard.support.support). ``python -m trainguard.support.reference [REPO_ROOT]`` writes both; a test keeps them in sync."""
from __future__ import annotations

import json
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

from pydantic import BaseModel

from trainguard.config import BLOCK, PathStr, TrainguardConfig
from trainguard.config.problems import unwrap as _unwrap


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
    if annotation is PathStr:
        return "path (non-empty)"
    return getattr(annotation, "__name__", str(annotation)).replace("Config", "").replace("Spec", "")


def _rows(model: type[BaseModel], prefix: str, out: list[str], nested: list):
    for name, field in model.model_fields.items():
        path = f"{prefix}.{field.alias or name}"
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
                   f"{_honoured_by(path)} | {field.description or ''} |")


def _honoured_by(path: str) -> str:
    """The reference's per-adapter column (trainguard.support.support is the one source)."""
    from trainguard.support.support import adapters, refusal

    key = path.split(".", 1)[1]
    cells = []
    for adapter in adapters():
        r = refusal(key, adapter)
        if r is None:
            cells.append(adapter)
        elif r.inert:
            cells.append(f"{adapter} (only {', '.join(f'`{json.dumps(v)}`' for v in r.inert)}: {r.reason})")
        else:
            cells.append(f"~~{adapter}~~ (refused: {r.reason})")
    return "<br>".join(cells)


def reference_markdown() -> str:
    out = ["# Config reference: the `trainguard` block", "",
           "Generated from `trainguard/config/` by `python -m trainguard.support.reference`; a test keeps it "
           "in sync. Unknown keys are errors. Every key is optional unless marked required.", "",
           "*Honoured by*: the adapters that apply the key (each adapter's `capabilities.py`, read by `trainguard/support/support.py`). A key an adapter "
           "cannot apply is refused by it when you set it: `ds_plugins.initialize` / `megatron_hooks.install` "
           "raise a ConfigError naming the key and the reason, never a silent no-op.", ""]
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
            out += ["| key | type | default | honoured by | meaning |", "|---|---|---|---|---|", *rows, ""]
        else:
            out += ["Sections: " + ", ".join(f"`{p}`" for _, p in nested) + ".", ""]
        queue = nested + queue
    return "\n".join(out).rstrip() + "\n"


REPO = Path(__file__).resolve().parents[2]  # (the checkout this module lies in: trainguard/support/reference.py)


def write_generated(root: str | os.PathLike = REPO) -> list[Path]:
    root = Path(root)
    schema_path = root / "configs" / "trainguard.schema.json"
    ref_path = root / "docs" / "config-reference.md"
    schema_path.write_text(json.dumps(json_schema(), indent=2, sort_keys=True) + "\n", encoding="utf-8")
    ref_path.write_text(reference_markdown(), encoding="utf-8")
    return [schema_path, ref_path]


if __name__ == "__main__":  # python -m trainguard.support.reference [REPO_ROOT]
    import sys

    for p in write_generated(sys.argv[1] if len(sys.argv) > 1 else REPO):
        print(f"wrote {p}")
