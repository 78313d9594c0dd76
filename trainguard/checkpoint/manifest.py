"""manifest.json: what a checkpoint holds, written last; and the verification against it.

    {"format": 2, "tag": ..., "step": ..., "created": ...,
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
from trainguard.checkpoint.layout import MANIFEST, STABLE, TRAJECTORY, StorageError, storage_error

FORMAT = 2  # 2: every file is listed, dotfiles and *.tmp included (1: trainguard before 2026-12 left those out)
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
        return cls.parse(json.loads((Path(tag_dir) / MANIFEST).read_text()))

    @classmethod
    def parse(cls, data: dict) -> "Manifest":
        """From a manifest's parsed JSON (the bytes a caller verified: never read again)."""
        return cls(tag=data["tag"], step=int(data["step"]), files=data["files"], layout=data.get("layout", {}),
                   lineage=data.get("lineage", {}), health=data.get("health", {}),
                   created=float(data.get("created", 0.0)), format=int(data.get("format", FORMAT)))

    def write(self, tag_dir: str | os.PathLike) -> None:
        atomic_write_json(Path(tag_dir) / MANIFEST, self.to_json())

    @property
    def total_bytes(self) -> int:
        return sum(int(f["size"]) for f in self.files.values())


def _transient(rel: str) -> bool:
    """An advisory file being written atomically right now (fsio.atomic_write_text's ``.<name>.tmp.<pid>``
    of the stable mark or the trajectory, at the top of a committed checkpoint): not part of it."""
    if "/" in rel or os.sep in rel:
        return False
    return any(rel.startswith(f".{name}.tmp.") for name in NOT_LISTED)


def _format1_unlisted(rel: str) -> bool:
    """What a format-1 manifest left out by design: dotfiles and ``*.tmp`` (dist_checkpointing's .metadata)."""
    name = os.path.basename(rel)
    return name.startswith(".") or name.endswith(".tmp")


def list_files(tag_dir: str | os.PathLike) -> list[str]:
    """Every file below ``tag_dir`` but the top-level manifest, its signature and the advisory marks:
    dotfiles (dist_checkpointing's ``.metadata``, a pickle) and ``*.tmp`` files included -- whatever a
    loader may open must be hashed, and whatever is not hashed must not be there."""
    root = Path(tag_dir)
    out = []
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            rel = os.path.relpath(os.path.join(dirpath, name), root)
            if rel not in NOT_LISTED and not _transient(rel):
                out.append(rel)
    return sorted(out)


def _entries(tag_dir: Path) -> tuple[list[str], str | None]:
    """Every entry below ``tag_dir`` as a relative path (symlinked folders listed, never followed), and the
    first one that is not a regular file or a real folder (a symlink, a FIFO, a device, a socket), if any."""
    import stat

    out, odd = [], None
    for dirpath, dirnames, filenames in os.walk(tag_dir, followlinks=False):
        for name in sorted(dirnames) + sorted(filenames):
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, tag_dir)
            mode = os.lstat(full).st_mode
            if stat.S_ISDIR(mode):
                continue
            out.append(rel)
            if not stat.S_ISREG(mode) and odd is None:
                odd = rel
    return out, odd


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
    io_error: bool = False  # the storage failed to read (EIO, ESTALE, ...): no verdict on the checkpoint itself
    digest: str | None = None  # sha256 of the manifest bytes verified (what every rank then pins)


def inside(rel: str) -> bool:
    """Whether a manifest entry names a file inside its checkpoint (relative, no '..', no drive)."""
    from pathlib import PurePosixPath, PureWindowsPath

    p = PurePosixPath(rel)
    return bool(rel) and not p.is_absolute() and ".." not in p.parts and not PureWindowsPath(rel).drive \
        and "\x00" not in rel


def verify(tag_dir: str | os.PathLike, checksums: bool = True, key: bytes | None = None) -> VerifyResult:
    """Check a committed checkpoint: (with ``key``) the manifest's HMAC first, then the manifest
    parses, every listed file exists as a regular file with its size and (when ``checksums``) its
    sha256, and nothing else is there (no unlisted file, dotfile or ``*.tmp``; no symlink, FIFO or
    device anywhere in it). Names the first bad file. Opens no checkpoint file but the manifest.
    Never raises: a malformed checkpoint is "invalid, here is why" -- rank 0 verifies before the
    broadcast of its choice, and an exception there would leave the other ranks waiting."""
    tag_dir = Path(tag_dir)
    res = None
    for attempt in range(IO_TRIES):  # (a storage error is retried: an NFS hiccup is no verdict on a checkpoint)
        if attempt:
            time.sleep(IO_BACKOFF_S * 2 ** (attempt - 1))
        try:
            res = _verify(tag_dir, checksums, key)
        except StorageError as e:  # (the manifest's read, retried already where it failed: no second round of tries)
            return _io_error(tag_dir, e.__cause__ or OSError(e.errno, str(e)))
        except OSError as e:
            if not storage_error(e):  # (a damaged or crafted checkpoint: a verdict on it, as before)
                return VerifyResult(False, tag_dir.name, MANIFEST, f"malformed checkpoint: {type(e).__name__}: {e}")
            res = _io_error(tag_dir, e)
        except Exception as e:  # (anything a crafted or damaged checkpoint can provoke)
            return VerifyResult(False, tag_dir.name, MANIFEST, f"malformed checkpoint: {type(e).__name__}: {e}")
        if not res.io_error:
            return res
    return res


IO_TRIES, IO_BACKOFF_S = 3, 0.5




def _io_error(tag_dir: Path, e: OSError) -> VerifyResult:
    where = Path(e.filename).name if getattr(e, "filename", None) else MANIFEST
    return VerifyResult(False, tag_dir.name, where, f"I/O error reading it ({type(e).__name__}: {e}), "
                        f"{IO_TRIES} tries", io_error=True)


def _well_formed(man: "Manifest") -> str | None:
    if not isinstance(man.files, dict) or not man.files:
        return "malformed manifest: 'files' must be a non-empty mapping of relative path -> {size, sha256}"
    for rel, want in man.files.items():
        if not isinstance(rel, str) or not isinstance(want, dict) or not isinstance(want.get("size"), int) \
                or isinstance(want.get("size"), bool) or want["size"] < 0 or not isinstance(want.get("sha256"), str) \
                or len(want["sha256"]) != 64:
            return f"malformed manifest: the entry {rel!r} must be {{'size': int >= 0, 'sha256': 64 hex digits}}"
    return None


def _verify(tag_dir: Path, checksums: bool, key: bytes | None) -> VerifyResult:
    import stat

    tag = tag_dir.name
    if tag_dir.is_symlink() or not tag_dir.is_dir():
        return VerifyResult(False, tag, tag, "not a directory (a symlink, or gone)")
    from trainguard.checkpoint.layout import REPLAYED, SIGNATURE, committed_digests, read_manifest, replaced

    signed = read_manifest(tag_dir, key)  # (read once: its HMAC checked on these bytes, these parsed, never read again)
    if signed.data is None and signed.digest is None:
        if not os.path.lexists(tag_dir / MANIFEST):
            return VerifyResult(False, tag, MANIFEST, "no manifest: the checkpoint was never committed")
        return VerifyResult(False, tag, MANIFEST, "the manifest is not a regular file")
    if signed.why is not None:
        unsigned = key is not None and signed.why.startswith(("unauthenticated", "HMAC"))
        return VerifyResult(False, tag, SIGNATURE if unsigned else MANIFEST, signed.why)
    try:
        man = Manifest.parse(signed.data)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return VerifyResult(False, tag, MANIFEST, f"unreadable manifest: {e}")
    why = _well_formed(man)
    if why is not None:
        return VerifyResult(False, tag, MANIFEST, why)
    if man.tag != tag:  # (a signed manifest copied under another tag: another step's state under this name)
        return VerifyResult(False, tag, MANIFEST, f"the manifest is checkpoint {man.tag!r}'s, not this folder's ({tag!r})")
    if key is not None and replaced(committed_digests(tag_dir.parent, key), tag, signed.digest):
        return VerifyResult(False, tag, MANIFEST, f"{REPLAYED}: refused, never loaded")
    present, odd = _entries(tag_dir)
    if odd is not None:
        return VerifyResult(False, tag, odd, "not a regular file (a symlink, FIFO or device): refused, never read", man)
    for rel, want in sorted(man.files.items()):
        if not inside(rel):
            return VerifyResult(False, tag, rel, "a manifest entry outside the checkpoint (absolute, or with '..'): "
                                "refused, never read", man)
        p = tag_dir / rel
        try:
            st = os.lstat(p)
        except OSError as e:
            if storage_error(e):
                raise  # (retried by verify)
            return VerifyResult(False, tag, rel, "missing", man)
        if not stat.S_ISREG(st.st_mode):
            return VerifyResult(False, tag, rel, "not a regular file: refused, never read", man)
        if st.st_size != int(want["size"]):
            return VerifyResult(False, tag, rel, f"size {st.st_size} != {want['size']} (truncated or grown)", man)
        if checksums:
            digest, _ = sha256_file(p)
            if digest != want["sha256"]:
                return VerifyResult(False, tag, rel, "sha256 mismatch (corrupt)", man)
    extra = sorted(set(present) - set(man.files) - NOT_LISTED - {r for r in present if _transient(r)})
    if man.format < 2:  # (written before every file was listed: its dotfiles and *.tmp were never hashed -- what
        extra = [r for r in extra if not _format1_unlisted(r)]  # it guaranteed is all an older checkpoint can give)
    if extra:
        return VerifyResult(False, tag, extra[0], "file not in the manifest", man)
    return VerifyResult(True, tag, manifest=man, digest=signed.digest)
