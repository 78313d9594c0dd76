"""Where a checkpoint directory keeps things, and what a valid tag is."""
from __future__ import annotations

import os
import re
from pathlib import Path

from trainguard.errors import TrainguardError

MANIFEST = "manifest.json"
STABLE = "stable.json"
TRAJECTORY = "trajectory.json"
LATEST = "latest"           # also DeepSpeed's pointer file: load_checkpoint(dir) reads it
STAGING = ".staging"
SIDECAR = "trainguard"      # per-rank RNG and data position, inside the tag directory
GUARD_STATE = "guard.json"  # the guard's state (statistics, budgets, quarantine), in SIDECAR

_TAG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


class CheckpointError(TrainguardError):
    """A checkpoint could not be saved, verified or loaded (the message names the file)."""


def validate_tag(tag: str) -> str:
    tag = str(tag)
    if not _TAG.match(tag) or ".." in tag:
        raise CheckpointError(f"invalid checkpoint tag {tag!r}: use letters, digits, '_', '-', '.' "
                              "(no path separators, no '..', at most 128 characters)")
    return tag


def check_own_dir(mine: str | None, theirs: dict[str, str | None], framework: str) -> None:
    """trainguard's ``checkpoint.dir`` and one of the framework's own checkpoint directories (``theirs``: the flag
    naming each) in one folder would fight over it (the framework's tracker file and step folders beside trainguard's
    tags and ``latest``): refused, naming the flag."""
    from trainguard.errors import ConfigError

    for flag, path in theirs.items() if mine else ():
        if path and Path(path).resolve() == Path(mine).resolve():
            raise ConfigError([("trainguard.checkpoint.dir", f"{mine} is {framework}'s {flag} directory: give "
                               f"trainguard's snapshots a directory of their own (e.g. {Path(mine) / 'trainguard'})")])


def step_tag(step: int) -> str:
    return f"step{step:08d}"


class CheckpointLayout:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.invalid_names: list[str] = []

    def tag_dir(self, tag: str) -> Path:
        return self.root / validate_tag(tag)

    def staging_root(self, nonce: str) -> Path:
        """DeepSpeed writes into ``<staging_root>/<tag>``; renamed to ``<root>/<tag>`` on commit."""
        return self.root / STAGING / validate_tag(nonce)

    def latest(self) -> str | None:
        try:
            tag = (self.root / LATEST).read_text().strip()
        except OSError:
            return None
        try:
            return validate_tag(tag)
        except CheckpointError:
            return None

    def steps(self) -> list[tuple[str, int]]:
        """``(tag, step)`` of the directories that look like committed checkpoints (a manifest
        exists), oldest first by the step recorded in the manifest, then by name."""
        import json

        out = []
        self.invalid_names = []  # committed-looking directories whose name is no valid tag: passed over
        if not self.root.is_dir():
            return out
        for d in self.root.iterdir():
            if d.is_symlink() or not d.is_dir() or d.name.startswith(".") or not (d / MANIFEST).is_file():
                continue
            if not _TAG.match(d.name) or ".." in d.name:
                self.invalid_names.append(d.name)
                continue
            try:
                step = int(json.loads((d / MANIFEST).read_text()).get("step", -1))
            except Exception:  # (malformed: verify says why; the listing never crashes rank 0)
                step = -1
            out.append((step, d.name))
        return [(name, step) for step, name in sorted(out)]

    def passed_over(self) -> list[dict]:
        """What :meth:`steps` passed over (after a call): directories whose name is no valid tag,
        in the shape of a ``checkpoint_invalid`` detail."""
        return [{"tag": name, "bad_file": name, "reason": "not a valid tag name: passed over", "dir": str(self.root)}
                for name in self.invalid_names]

    def tags(self) -> list[str]:
        return [tag for tag, _ in self.steps()]
