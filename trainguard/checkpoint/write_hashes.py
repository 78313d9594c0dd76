"""The hashes of a framework's files as it writes them, for a framework whose writer trainguard does not call
itself (megatron's dist_checkpointing: its own threads -- forked processes on megatron-core 0.16 -- write the
``.distcp`` files, torch.distributed.checkpoint writes the pickled ``.metadata`` and renames it into place,
dist_checkpointing writes its ``metadata.json``, an older release ``common.pt`` with ``torch.save``).

While :func:`hashed_writes` is open, every file opened for writing under ``root`` -- through ``open``, torch
DCP's ``FileSystem.create_stream`` or ``torch.save`` of a path -- is hashed from the bytes passed to it, and a
rename under ``root`` carries its hash along. A forked child reports its files through a pipe made before the
fork. What is signed at the commit is then what this job wrote, never bytes read back from the folder.
A file written with a seek backwards cannot be hashed on the way: it is named in ``rewritten`` and the
commit hashes it from the staging folder (the job's own, 0700). Reads, and writes elsewhere, pass through.
"""
from __future__ import annotations

import builtins
import contextlib
import hashlib
import json
import os
import threading
from pathlib import Path

import torch

__all__ = ["hashed_writes", "WriteHashes"]

_LOCK = threading.Lock()  # one save's patches at a time in a process


class WriteHashes:
    """The table of one save: ``{relative path: {"sha256", "size"}}`` of the files written under ``root``."""

    def __init__(self, root: Path):
        self.root = os.path.abspath(root)
        self.table: dict[str, dict] = {}
        self.rewritten: set[str] = set()   # written with a seek back: hashed at the commit instead
        self._pid = os.getpid()
        self._read, self._write = os.pipe()  # (a forked writer's reports, drained as they come: never a full pipe)
        self._reports = bytearray()
        self._drain = threading.Thread(target=self._drained, name="trainguard-write-hashes", daemon=True)
        self._drain.start()

    def _drained(self) -> None:
        while True:
            try:
                chunk = os.read(self._read, 1 << 16)
            except OSError:
                return
            if not chunk:  # (every write end closed: this process's at collect(), the children's at their exit)
                return
            self._reports += chunk

    def inside(self, path) -> str | None:
        if not isinstance(path, (str, os.PathLike)):
            return None
        full = os.path.abspath(os.fspath(path))
        return os.path.relpath(full, self.root) if full.startswith(self.root + os.sep) else None

    def record(self, rel: str, digest: str | None, size: int) -> None:
        if os.getpid() == self._pid:
            self._put(rel, digest, size)
        else:  # a forked writer: one JSON line per file, shorter than PIPE_BUF (written whole)
            os.write(self._write, (json.dumps([rel, digest, size]) + "\n").encode())

    def _put(self, rel: str, digest: str | None, size: int) -> None:
        if digest:
            self.table[rel] = {"sha256": digest, "size": size}
            self.rewritten.discard(rel)
        else:
            self.table.pop(rel, None)
            self.rewritten.add(rel)

    def renamed(self, src, dst) -> None:
        a, b = self.inside(src), self.inside(dst)
        if a is not None and a in self.table:
            entry = self.table.pop(a)
            if b is not None:
                self.table[b] = entry
        elif a is not None and a in self.rewritten:
            self.rewritten.discard(a)
            if b is not None:
                self.rewritten.add(b)

    def collect(self, within: float = 30.0) -> None:
        """The forked writers' reports (they have exited: the framework's save returned)."""
        os.close(self._write)
        self._write = -1
        self._drain.join(within)
        for line in bytes(self._reports).decode().splitlines():
            rel, digest, size = json.loads(line)
            self._put(rel, digest or None, int(size))

    def close(self) -> None:
        for fd in (self._write, self._read):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)


class _Hashing:
    """A file opened for writing, hashed as bytes go through it."""

    def __init__(self, f, rel: str, owner: WriteHashes):
        self._f, self._rel, self._owner = f, rel, owner
        self._h, self._size, self._seekback, self._done = hashlib.sha256(), 0, False, False

    def write(self, b):
        if isinstance(b, str):
            data = b.encode(getattr(self._f, "encoding", None) or "utf-8")
        else:
            data = memoryview(b).cast("B")
        n = self._f.write(b)
        if isinstance(n, int) and not isinstance(b, str) and n < len(data):
            data = data[:n]  # (a raw file's short write: the rest is the writer's to write again)
        if not self._seekback:
            self._h.update(data)
            self._size += len(data)
        return n

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def seek(self, pos, whence=0):
        out = self._f.seek(pos, whence)
        if out != self._size:
            self._seekback = True
        return out

    def close(self):
        if not self._done:
            self._done = True
            self._f.close()
            self._owner.record(self._rel, None if self._seekback else self._h.hexdigest(), self._size)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __getattr__(self, name):
        return getattr(self._f, name)


@contextlib.contextmanager
def hashed_writes(root: Path):
    """Hash every file written under ``root`` while open; yields the :class:`WriteHashes` (complete on exit)."""
    from torch.distributed.checkpoint import filesystem

    hashes = WriteHashes(Path(root))
    real_open, real_save = builtins.open, torch.save
    real_stream, real_rename = filesystem.FileSystem.create_stream, filesystem.FileSystem.rename

    def writing(mode) -> bool:
        return isinstance(mode, str) and any(c in mode for c in "wax+")

    def hashing_open(file, mode="r", *args, **kwargs):
        rel = hashes.inside(file) if writing(mode) else None
        f = real_open(file, mode, *args, **kwargs)
        return _Hashing(f, rel, hashes) if rel is not None else f

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        rel = hashes.inside(path) if writing(mode) else None
        with real_stream(self, path, mode) as stream:
            if rel is None:
                yield stream
                return
            wrapped = _Hashing(stream, rel, hashes)
            yield wrapped
            if not wrapped._done:  # (not closed by the writer: the real stream closes with the context manager)
                wrapped._done = True
                hashes.record(rel, None if wrapped._seekback else wrapped._h.hexdigest(), wrapped._size)

    def rename(self, path, new_path):
        real_rename(self, path, new_path)
        hashes.renamed(path, new_path)

    def save(obj, f, *args, **kwargs):
        rel = hashes.inside(f)
        if rel is None:
            return real_save(obj, f, *args, **kwargs)
        with real_open(f, "wb") as out:
            hashed = _Hashing(out, rel, hashes)
            real_save(obj, hashed, *args, **kwargs)
            hashed.close()

    with _LOCK:
        builtins.open, torch.save = hashing_open, save
        filesystem.FileSystem.create_stream, filesystem.FileSystem.rename = create_stream, rename
        try:
            yield hashes
            hashes.collect()
        finally:
            builtins.open, torch.save = real_open, real_save
            filesystem.FileSystem.create_stream, filesystem.FileSystem.rename = real_stream, real_rename
            hashes.close()
