"""What every section of the "trainguard" block shares (trainguard.config): the strict frozen base model, a path
that must be usable, an extension named by type."""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field


def _usable_path(value: str) -> str:
    if not value or not value.strip():
        raise ValueError("an empty path: give a file or directory, or null")
    if "\x00" in value:
        raise ValueError("a path with a NUL character cannot be opened")
    return value


# a file or directory the run writes to or reads from: checked here, not at its first use on every rank
PathStr = Annotated[str, AfterValidator(_usable_path)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)  # (JSON: true is no number, 0 no bool)


class PluginSpec(_Section):
    """An extension by name: a registered one, or your own ``package.module:Name`` (trainguard/plugins.py)."""

    type: str = Field(min_length=1, description="A registered name, or 'package.module:Name' of a class or factory.")
    options: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments it is built with.")
