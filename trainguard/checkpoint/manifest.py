"""manifest.json: what a checkpoint holds, written last; and the verification against it.

    {"format": 1, "tag": ..., "step": ..., "created": ...,
     "files": {"<relative path>": {"sha256": ..., "size": ...}, ...},
     "layout": {"world": 2, "dp": 2, "tp": 1, "pp": 1, "zero_stage": 2, "dtype": "bf16"},
     "lineage": {"dataset_id": ..., "dataset_version": ..., "config_hash": ..., "versions": {...},
                 "code_revision": ...},
     "health": {"loss": ..., "loss_median": ..., "skipped_steps": ..., "loss_scale": ...,
                "recent_anomalies": [...]}}

Files written after the commit (the stable mark, the post-save trajectory) are not listed: they are
written atomically and are advisory; the files the manifest lists are what resume needs.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from trainguard.checkpoint.fsio import atomic_write_json, sha256_file
from trainguard.checkpoint.layout import MANIFEST, STABLE, TRAJECTORY

FORMAT = 1
NOT_LISTED = {MANIFEST, STABLE, TRAJECTORY, "manifest.hmac"}  # (the last: trainguard.checkpoint.auth)


@dataclass
class Manifest:
    tag: str
    step: int
    files: dict[str, dict]
    layout: dict = field(default_factory=dict)
    lineage: dict = field(default_factory=dict)
    health: dict = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    format: int = FORMAT

    def to_json(self) -> dict:
        return {"format": self.format, "tag": self.tag, "step": self.step, "created": self.created,
                "files": self.files, "layout": self.layout, "lineage": self.lineage, "health": self.health}

    @classmethod
    def read(cls, tag_dir: str | os.PathLike) -> "Manifest":
        data = json.loads((Path(tag_dir) / MANIFEST).read_text())
        return cls(tag=data["tag"], step=int(data["step"]), files=data["files"], layout=data.get("layout", {}),
                   lineage=data.get("lineage", {}), health=data.get("health", {}),
                   created=float(data.get("created", 0.0)), format=int(data.get("format", FORMAT)))

    def write(self, tag_dir: str | os.PathLike) -> None:
        atomic_write_json(Path(tag_dir) / MANIFEST, self.to_json())

    @property
    def total_bytes(self) -> int:
        return sum(int(f["size"]) for f in self.files.values())


def list_files(tag_dir: str | os.PathLike) -> list[str]:
    root = Path(tag_dir)
    out = []
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            rel = os.path.relpath(os.path.join(dirpath, name), root)
            if rel not in NOT_LISTED and not name.startswith(".") and not name.endswith(".tmp"):
                out.append(rel)
    return sorted(out)


def hash_files(tag_dir: str | os.PathLike, rels: Iterable[str]) -> dict[str, dict]:
    root = Path(tag_dir)
    out = {}
    for rel in rels:
        digest, size = sha256_file(root / rel)
        out[rel] = {"sha256": digest, "size": size}
    return out


@dataclass(frozen=True)
class VerifyResult:
    ok: bool
    tag: str
    bad_file: str | None = None
    reason: str = ""
    manifest: Manifest | None = None


def inside(rel: str) -> bool:
    """Whether a manifest entry names a file inside its checkpoint (relative, no '..', no drive)."""
    from pathlib import PurePosixPath, PureWindowsPath

    p = PurePosixPath(rel)
    return bool(rel) and not p.is_absolute() and ".." not in p.parts and not PureWindowsPath(rel).drive \
        and "\x00" not in rel


def verify(tag_dir: str | os.PathLike, checksums: bool = True, key: bytes | None = None) -> VerifyResult:
    """Check a committed checkpoint: (with ``key``) the manifest's HMAC first, then the manifest
    parses, every listed file exists with its size and (when ``checksums``) its sha256, and no
    unlisted file appeared. Names the first bad file. Opens no checkpoint file but the manifest."""
    tag_dir = Path(tag_dir)
    tag = tag_dir.name
    if key is not None:
        from trainguard.checkpoint.auth import SIGNATURE, problem

        why = problem(tag_dir, key)
        if why is not None:
            return VerifyResult(False, tag, SIGNATURE, why)
    try:
        man = Manifest.read(tag_dir)
    except FileNotFoundError:
        return VerifyResult(False, tag, MANIFEST, "no manifest: the checkpoint was never committed")
    except (OSError, ValueError, KeyError) as e:
        return VerifyResult(False, tag, MANIFEST, f"unreadable manifest: {e}")
    for rel, want in sorted(man.files.items()):
        if not inside(rel):
            return VerifyResult(False, tag, rel, "a manifest entry outside the checkpoint (absolute, or with '..'): "
                                "refused, never read", man)
        p = tag_dir / rel
        try:
            size = p.stat().st_size
        except OSError:
            return VerifyResult(False, tag, rel, "missing", man)
        if size != int(want["size"]):
            return VerifyResult(False, tag, rel, f"size {size} != {want['size']} (truncated or grown)", man)
        if checksums:
            digest, _ = sha256_file(p)
            if digest != want["sha256"]:
                return VerifyResult(False, tag, rel, "sha256 mismatch (corrupt)", man)
    extra = sorted(set(list_files(tag_dir)) - set(man.files))
    if extra:
        return VerifyResult(False, tag, extra[0], "file not in the manifest", man)
    return VerifyResult(True, tag, manifest=man)
