"""Where a checkpoint directory keeps things, what a valid tag is, and its listing: each manifest read once and
trusted only when signed (with the run's key), a storage error raised as one, never a verdict."""
from __future__ import annotations

import errno as errnos
import hashlib
import hmac
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from trainguard.errors import TrainguardError

MANIFEST = "manifest.json"
STABLE = "stable.json"
TRAJECTORY = "trajectory.json"
LATEST = "latest"           # also DeepSpeed's pointer file: load_checkpoint(dir) reads it
STAGING = ".staging"
SIDECAR = "trainguard"      # per-rank RNG and data position, inside the tag directory
GUARD_STATE = "guard.json"  # the guard's state (statistics, budgets, quarantine), in SIDECAR
SIGNATURE = "manifest.hmac"  # the manifest's HMAC with the run's key (trainguard.checkpoint.auth writes it)
INDEX = ".index/committed.json"  # with a key: each tag's manifest digest as last committed (trainguard.checkpoint.signed)

_TAG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


class CheckpointError(TrainguardError):
    """A checkpoint could not be saved, verified or loaded (the message names the file)."""


def valid_tag(tag: str) -> bool:
    """Whether ``tag`` names a checkpoint folder (letters, digits, '_', '-', '.'; no '..')."""
    return bool(_TAG.match(tag)) and ".." not in tag


def validate_tag(tag: str) -> str:
    tag = str(tag)
    if not valid_tag(tag):
        raise CheckpointError(f"invalid checkpoint tag {tag!r}: use letters, digits, '_', '-', '.' "
                              "(no path separators, no '..', at most 128 characters)")
    return tag


# ------------------------------------------------------------ a record read once, trusted only when signed
class StorageError(CheckpointError):
    """The storage failed to read a checkpoint's record (EIO, ESTALE, ...): no verdict on the checkpoint."""

    def __init__(self, path: Path, err: OSError):
        self.path, self.errno = Path(path), err.errno
        super().__init__(f"{path}: I/O error ({errnos.errorcode.get(err.errno, err.errno)}: {err.strerror}): the "
                         "storage failed to read it; nothing is judged, moved or deleted on it -- fix the storage and "
                         "restart")


def storage_error(e: OSError) -> bool:
    """A storage failure, not a property of the checkpoint (a missing file, a path through a file, a name too long,
    a permission are verdicts on the checkpoint)."""
    return e.errno in {errnos.EIO, errnos.ESTALE, errnos.ETIMEDOUT, errnos.EAGAIN, errnos.EINTR, errnos.ENOTCONN,
                       getattr(errnos, "EREMOTEIO", -1), errnos.EBUSY, errnos.ENOLCK}


MAX_SMALL_FILE = 64 << 20  # a manifest, its signature, a mark, the index: larger is no file trainguard wrote


def read_regular(path: Path, max_bytes: int = MAX_SMALL_FILE) -> bytes:
    """A regular file's bytes, never through a symlink, a FIFO or a device, never one larger than ``max_bytes`` (a
    planted 1 TB manifest would take rank 0's memory on every listing): a CheckpointError says which."""
    import stat

    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{path}: not a regular file: refused")
        if st.st_size > max_bytes:
            raise CheckpointError(f"{path}: {st.st_size} bytes, more than any file of its kind ({max_bytes}): refused")
        chunks, size = [], 0
        while True:
            block = os.read(fd, 8 << 20)
            size += len(block)
            if not block or size > max_bytes:  # (grown since the fstat: refused alike)
                break
            chunks.append(block)
        if size > max_bytes:
            raise CheckpointError(f"{path}: more than {max_bytes} bytes: refused")
        return b"".join(chunks)
    finally:
        os.close(fd)


IO_TRIES, IO_BACKOFF_S = 3, 0.5  # (an NFS hiccup is retried before it is called a storage error)


def read_optional(path: Path) -> bytes | None:
    """:func:`read_regular`; None when the file is not there (or not a file: a verdict); StorageError on a storage
    error that persists through ``IO_TRIES`` reads."""
    import time

    for attempt in range(IO_TRIES):
        try:
            return read_regular(path)
        except OSError as e:
            if not storage_error(e):
                return None
            if attempt == IO_TRIES - 1:
                raise StorageError(path, e) from e
            time.sleep(IO_BACKOFF_S * 2 ** attempt)
        except CheckpointError:
            return None


@dataclass(frozen=True)
class SignedManifest:
    """A manifest as read once: its parsed content (None when unreadable), the sha256 of those bytes, and why it is
    not to be trusted (None: it is -- signed with the key, or no key is set)."""
    data: dict | None
    digest: str | None
    why: str | None

    @property
    def step(self) -> int | None:
        step = (self.data or {}).get("step")
        if isinstance(step, bool) or not isinstance(step, (int, str)):
            return None
        try:
            return int(step)  # (as Manifest.read takes it: "5" is 5)
        except ValueError:
            return None


def signature_of(manifest: bytes, key: bytes) -> str:
    """The HMAC-SHA256 of a manifest's bytes (hex): what ``manifest.hmac`` holds."""
    return hmac.new(key, manifest, hashlib.sha256).hexdigest()


def io_entry(e: Exception, root: Path) -> dict:
    """A storage error as a ``checkpoint_invalid`` detail with ``io_error`` (the file it names, or ``root``): what rank
    0 broadcasts instead of raising before a collective."""
    path = getattr(e, "path", None) or Path(getattr(e, "filename", None) or root)
    return {"tag": path.parent.name if path != Path(root) else Path(root).name, "bad_file": path.name,
            "reason": str(e), "dir": str(root), "io_error": True}


def read_manifest(tag_dir: str | os.PathLike, key: bytes | None) -> SignedManifest:
    """The manifest of ``tag_dir``, read once; with ``key``, its HMAC checked on those bytes before they are parsed."""
    tag_dir = Path(tag_dir)
    raw = read_optional(tag_dir / MANIFEST)
    if raw is None:
        return SignedManifest(None, None, "no readable manifest (missing, or not a regular file)")
    digest = hashlib.sha256(raw).hexdigest()
    if key is not None:
        stored = read_optional(tag_dir / SIGNATURE)
        if stored is None:
            return SignedManifest(None, digest, "unauthenticated: no manifest.hmac (this run requires checkpoints "
                                                "signed with its key)")
        if not hmac.compare_digest(stored.strip(), signature_of(raw, key).encode()):
            return SignedManifest(None, digest, "HMAC mismatch: the manifest was altered, or signed with another key")
    try:
        data = json.loads(raw)
    except ValueError as e:
        return SignedManifest(None, digest, f"unreadable manifest: {e}")
    if not isinstance(data, dict):
        return SignedManifest(None, digest, "malformed manifest: not a JSON object")
    return SignedManifest(data, digest, None)


def index_mac(key: bytes, digests: dict) -> str:
    payload = json.dumps(digests, sort_keys=True, separators=(",", ":"))
    return hmac.new(key, f"trainguard-index\0{payload}".encode(), hashlib.sha256).hexdigest()


def committed_digests(root: Path, key: bytes | None) -> dict[str, str]:
    """``{tag: the sha256 of the manifest last committed under it}`` from the root's signed index (with ``key``; {}
    without one, or when there is none that verifies -- an older release's folder, another key's)."""
    raw = read_optional(root / INDEX) if key is not None else None
    try:
        body = json.loads(raw) if raw is not None else {}
        digests, mac = body["digests"], body["hmac"]
    except (ValueError, KeyError, TypeError):
        return {}
    ok = isinstance(digests, dict) and isinstance(mac, str) and hmac.compare_digest(mac, index_mac(key, digests))
    return digests if ok else {}


REPLAYED = "signed, but not the checkpoint last committed under this tag (an older copy put back?)"


def replaced(last: dict[str, str], tag: str, digest: str | None) -> bool:
    """Whether the index (``last``: :func:`committed_digests`) names another manifest than ``digest`` for ``tag``."""
    return digest is not None and last.get(tag, digest) != digest


def misplaced(tag_dir: Path, man: SignedManifest) -> str | None:
    """Why a verified manifest may not speak for ``tag_dir``: it names another tag (a signed manifest copied into
    another checkpoint's folder -- its step would decide for that folder, a mark would bind to it). None: in place."""
    tag = (man.data or {}).get("tag")
    if man.data is not None and tag != tag_dir.name:
        return f"the manifest is for tag {tag!r}, not {tag_dir.name!r} (copied from another checkpoint?)"
    return None


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
    """A checkpoint directory's listing. With ``key``, only checkpoints whose manifest verifies are listed: their
    step is read from the verified bytes (trainguard.checkpoint.signed), and the others are passed over, named
    (:meth:`passed_over`) -- never a reason to keep, delete, load, roll back to or set aside anything."""

    def __init__(self, root: str | os.PathLike, key: bytes | None = None):
        self.root = Path(root)
        self.key = key
        self.invalid_names: list[str] = []
        self.unverified: dict[str, str] = {}  # tag -> why its manifest is not trusted (with a key)
        self.digests: dict[str, str] = {}     # tag -> sha256 of the manifest bytes listed
        self.data: dict[str, dict] = {}       # tag -> the manifest those bytes parse to (decisions read this)

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

    def committed(self) -> list[str]:
        """The names of the directories that look like committed checkpoints (a manifest is there), trusted or not:
        what tells a resume that the directory holds checkpoints (it fails closed when none is loadable)."""
        if not self.root.is_dir():
            return []
        return sorted(d.name for d in self.root.iterdir()
                      if not d.is_symlink() and d.is_dir() and not d.name.startswith(".") and (d / MANIFEST).is_file())

    def steps(self) -> list[tuple[str, int]]:
        """``(tag, step)`` of the committed checkpoints, oldest first by the step their manifest records, then by
        name. Each manifest is read once (with the key: verified on those bytes). Without a key a malformed one is
        listed at step -1 (verify says why); with one, an unverified one is passed over. A storage error raises
        StorageError (the file, the errno): never a step."""
        out = []
        self.invalid_names, self.unverified, self.digests, self.data = [], {}, {}, {}
        last = committed_digests(self.root, self.key)  # (with a key: what this root last committed under each tag)
        for name in self.committed():
            if not valid_tag(name):
                self.invalid_names.append(name)  # committed-looking, but no valid tag: passed over
                continue
            man = read_manifest(self.root / name, self.key)
            why = man.why or misplaced(self.root / name, man) or (
                REPLAYED if replaced(last, name, man.digest) else None)
            if self.key is not None and (why is not None or man.step is None):
                self.unverified[name] = why or "malformed manifest: no integer 'step'"
                continue
            self.digests[name], self.data[name] = man.digest, man.data or {}
            out.append((man.step if man.step is not None else -1, name))
        return [(name, step) for step, name in sorted(out)]

    def passed_over(self) -> list[dict]:
        """What :meth:`steps` passed over (after a call): directories whose name is no valid tag, and (with a key)
        those whose manifest does not verify, in the shape of a ``checkpoint_invalid`` detail."""
        return [{"tag": name, "bad_file": name, "reason": "not a valid tag name: passed over", "dir": str(self.root)}
                for name in self.invalid_names] + [
                {"tag": name, "bad_file": "manifest.hmac" if why.startswith(("unauthenticated", "HMAC")) else MANIFEST,
                 "reason": f"{why}: passed over, never used to decide", "dir": str(self.root)}
                for name, why in sorted(self.unverified.items(), reverse=True)]  # (newest first, as verify's)

    def tags(self) -> list[str]:
        return [tag for tag, _ in self.steps()]
