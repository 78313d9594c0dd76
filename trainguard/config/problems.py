"""How a bad "trainguard" block is told (trainguard.config): each problem of a validation error at its full key path,
an unknown key with the closest known one ("did you mean"), the known keys of its section."""
from __future__ import annotations

import difflib
import json
import types
import typing
from typing import Any, Union

from pydantic import BaseModel, ValidationError


def unwrap(annotation: Any) -> Any:
    """Optional[X] -> X, list[X] -> X (enough to walk our own models)."""
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return unwrap(args[0]) if len(args) == 1 else annotation
    if origin in (list, tuple):
        return unwrap(typing.get_args(annotation)[0])
    return annotation


def _field(model, key):
    for name, f in model.model_fields.items():
        if key in (name, f.alias):
            return f
    return None


def _model_at(root: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    model: Any = root
    for part in loc:
        if isinstance(part, int):
            continue
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or _field(model, part) is None:
            return None
        model = unwrap(_field(model, part).annotation)
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _path(block: str, loc: tuple) -> str:
    out = block
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


def told(err: ValidationError, root: type[BaseModel], block: str, faults_refused: str) -> list[tuple[str, str]]:
    """``err`` (validating ``root``, the block named ``block``) as (key path, what is wrong) pairs."""
    problems = []
    for e in err.errors(include_url=False):
        loc = tuple(e["loc"])
        if e["type"] == "extra_forbidden":
            model = _model_at(root, loc[:-1])
            known = sorted(f.alias or n for n, f in model.model_fields.items()) if model else []
            guess = _closest(str(loc[-1]), known)
            hint = f"; did you mean '{guess}'?" if guess else ""
            problems.append((_path(block, loc), f"unknown key{hint} (known: {', '.join(known)})"))
            continue
        msg = e["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        if msg == faults_refused:
            loc = ("faults",)
        if e["type"] not in ("missing", "value_error") and "input" in e:
            msg += f" (got {json.dumps(e['input'], default=str)})"
        problems.append((_path(block, loc), msg))
    return problems
