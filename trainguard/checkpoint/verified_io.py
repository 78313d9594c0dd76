"""Loads that deserialise only bytes this rank checked, whoever opens the files.

A framework's loader opens a checkpoint's files by path (or a file object opened on one), by itself: DeepSpeed's
``torch.load`` of each
``mp_rank_*`` / ZeRO file and of a universal checkpoint's per-parameter files, megatron's
``dist_checkpointing`` through torch.distributed.checkpoint's ``FileSystem.create_stream`` (its ``.metadata``
is a pickle, its ``*.distcp`` files hold the tensors) and, on older releases, ``torch.load`` of
``common.pt``. While :func:`verified_reads` is open, every such read of a file inside the checkpoint's
folder goes through a :class:`trainguard.checkpoint.reader.VerifiedReader`: the file is read once, its
size and sha256 compared with the manifest rank 0 verified (pinned by its digest), and the loader gets
those bytes from memory -- never the path again, so a file swapped after the check is never loaded, and
a file the manifest does not list is refused before it is read. Reads outside the folder pass through.

The cost: each file a rank touches is read whole (a file is hashed whole), once per load, and held in
memory until the load ends.
"""
from __future__ import annotations

import contextlib
import io
import os
import threading

import torch

from trainguard.checkpoint.layout import CheckpointError

__all__ = ["verified_reads", "load_weights"]

_LOCK = threading.RLock()  # one patched load at a time in a process (nested: restored in order)


def load_weights(reader, path) -> dict:
    """A file of trainguard's own (a sidecar, a shard of the in-memory tier): its checked bytes, loaded weights-only."""
    return torch.load(io.BytesIO(reader.read(path)), weights_only=True)


@contextlib.contextmanager
def verified_reads(reader):
    """Route ``torch.load(path)`` and torch.distributed.checkpoint's reads of files under ``reader.tag_dir``
    through ``reader`` (``None``: nothing changes)."""
    if reader is None:
        yield
        return
    from torch.distributed.checkpoint import filesystem

    root = str(reader.tag_dir)
    cache: dict[str, bytes] = {}

    def inside(path) -> str | None:
        if not isinstance(path, (str, os.PathLike)):
            return None
        full = os.path.abspath(os.fspath(path))
        return full if full == root or full.startswith(root + os.sep) else None

    refused: list[CheckpointError] = []

    def data(full: str) -> bytes:
        if full not in cache:
            try:
                cache[full] = reader.read(full)
            except CheckpointError as e:
                refused.append(e)
                raise
        return cache[full]

    real_load = torch.load
    real_stream = filesystem.FileSystem.create_stream

    def load(f, *args, **kwargs):
        # a path, or a file object opened on one (``torch.load(open(p, "rb"))``: its name says which file)
        full = inside(f) or (inside(getattr(f, "name", None)) if hasattr(f, "read") else None)
        return real_load(io.BytesIO(data(full)) if full else f, *args, **kwargs)

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        full = inside(path)
        if full and "r" in mode and "+" not in mode:
            yield io.BytesIO(data(full))
            return
        with real_stream(self, path, mode) as stream:
            yield stream

    with _LOCK:
        torch.load, filesystem.FileSystem.create_stream = load, create_stream
        try:
            yield
        except BaseException as e:  # (DCP wraps what a rank met in a CheckpointException, a BaseException)
            if refused and not isinstance(e, (CheckpointError, KeyboardInterrupt, SystemExit)):
                raise refused[0] from e
            raise
        finally:
            torch.load, filesystem.FileSystem.create_stream = real_load, real_stream
            cache.clear()
