"""Durable, atomic file operations: what the commit protocol is made of."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path



def _umask() -> int:
    mask = os.umask(0o022)  # (read once, at import: os.umask can only be read by setting it)
    os.umask(mask)
    return mask


# checkpoint files and folders follow the user's umask (0644 / 0755 under the usual 022; 0600 / 0700 under
# 077); the in-memory tier's are always private (trainguard.checkpoint.private)
UMASK = _umask()
FILE_MODE = 0o666 & ~UMASK
DIR_MODE = 0o777 & ~UMASK
PRIVATE_FILE_MODE = 0o600
PRIVATE_DIR_MODE = 0o700


def fsync_file(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def atomic_write_text(path: str | os.PathLike, text: str, durable: bool = True, mode: int | None = None) -> None:
    """Write ``path`` so that readers see the old content or the new one, never a mix. The temporary file is created
    exclusively under a random name (``.<name>.tmp.<random>``, 0600 until written): never opened or chmodded through
    a link someone who may write the folder planted. ``durable``: fsynced (the file and the folder). ``mode``: the
    file's (the umask's by default)."""
    import tempfile

    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            if durable:
                os.fsync(f.fileno())
            os.fchmod(f.fileno(), FILE_MODE if mode is None else mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if durable:
        fsync_dir(path.parent)


def atomic_write_json(path: str | os.PathLike, data, mode: int | None = None) -> None:
    atomic_write_text(path, json.dumps(data, indent=1, sort_keys=True) + "\n", mode=mode)


def write_json_hashed(path: str | os.PathLike, data) -> dict:
    """:func:`atomic_write_json`, returning ``{"sha256", "size"}`` of the bytes as produced (never read back:
    what is signed is what this process wrote, not what a writer of the folder may have put there since)."""
    text = json.dumps(data, indent=1, sort_keys=True) + "\n"
    atomic_write_text(path, text)
    raw = text.encode("utf-8")
    return {"sha256": hashlib.sha256(raw).hexdigest(), "size": len(raw)}


_progress = None  # called per chunk hashed (trainguard.checkpoint.manager sets it: the watchdog's heartbeat)


def on_progress(fn) -> None:
    """``fn()`` is called after each chunk a hash reads: a checkpoint of terabytes takes longer to hash and verify
    than the watchdog's hang_timeout_s, and must not look like a hang."""
    global _progress
    _progress = fn


def beat_from_training_thread(heart) -> None:
    """Hashing and verifying beat ``heart`` per chunk, in the phase the rank is in -- from the calling (training)
    thread only: a background writer's progress would hide a training thread that really hangs."""
    import threading

    if heart is None:
        return
    main = threading.get_ident()

    def beat() -> None:
        if threading.get_ident() == main:
            heart.beat(heart.phase)

    on_progress(beat)


def progressed() -> None:
    if _progress is not None:
        _progress()


def sha256_file(path: str | os.PathLike, chunk: int = 8 << 20) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    import stat

    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # (a FIFO swapped in after an lstat never blocks the reader)
        os.close(fd)
        raise OSError(f"{path}: not a regular file: refused, never read")
    with os.fdopen(fd, "rb") as f:
        while True:
            block = f.read(chunk)
            if not block:
                break
            h.update(block)
            size += len(block)
            progressed()
    return h.hexdigest(), size


def make_durable(root: str | os.PathLike, file_mode: int | None = None, dir_mode: int | None = None) -> None:
    """fsync every file and directory below ``root`` (bottom-up) and set permissions explicitly
    (the umask's by default; ``PRIVATE_*`` for the in-memory tier)."""
    for dirpath, dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            p = os.path.join(dirpath, name)
            os.chmod(p, FILE_MODE if file_mode is None else file_mode)
            fsync_file(p)
        os.chmod(dirpath, DIR_MODE if dir_mode is None else dir_mode)
        fsync_dir(dirpath)


class HashingFile:
    """A write-only file that computes its sha256 while it is written (in a helper thread, so the
    hash overlaps the serialisation) and is fsynced on close. Saves a read-back of every byte."""

    def __init__(self, path: str | os.PathLike, chunk_queue: int = 64):
        import queue
        import threading

        self.path = Path(path)
        self._f = open(self.path, "wb")
        self._h = hashlib.sha256()
        self.size = 0
        self._q: "queue.Queue" = queue.Queue(maxsize=chunk_queue)
        self._t = threading.Thread(target=self._hash, daemon=True)
        self._t.start()
        self.digest: str | None = None

    def _hash(self) -> None:
        while True:
            b = self._q.get()
            if b is None:
                return
            self._h.update(b)

    def write(self, b) -> int:
        b = bytes(b) if not isinstance(b, bytes) else b  # the caller may reuse its buffer
        n = self._f.write(b)
        self.size += len(b)
        self._q.put(b)
        return n

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        if self._f.closed:
            return
        self._q.put(None)
        self._t.join()
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.chmod(self.path, FILE_MODE)
        self.digest = self._h.hexdigest()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def save_hashed(obj, path: str | os.PathLike, zipfile: bool = False) -> dict:
    """``torch.save`` into ``path`` durably; returns ``{"sha256", "size"}`` computed on the way."""
    import torch

    with HashingFile(path) as f:
        torch.save(obj, f, _use_new_zipfile_serialization=zipfile)
    return {"sha256": f.digest, "size": f.size}


def save_buffered(obj, path: str | os.PathLike) -> dict:
    """``torch.save`` into memory, hashed, then written in one call: cheaper than :func:`save_hashed`'s
    helper thread for a shard written to node memory (a tmpfs), where there is no disk to overlap."""
    import io

    import torch

    buf = io.BytesIO()
    torch.save(obj, buf, _use_new_zipfile_serialization=False)
    data = buf.getbuffer()
    with open(path, "wb") as f:
        f.write(data)
    os.chmod(path, FILE_MODE)
    return {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
