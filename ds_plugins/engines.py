"""Stand-ins for DeepSpeed's checkpoint engine while trainguard saves and loads: each file hashed as it is written
(a synchronous save), captured to host memory (an async save, the in-memory tier), or read once and checked
against the verified manifest before it is deserialised (a load)."""
from __future__ import annotations

import contextlib

import torch

from trainguard.checkpoint.fsio import save_hashed


class _Hashing:
    """Stands in for DeepSpeed's torch checkpoint engine during a synchronous save: the same
    ``torch.save``, into a file that is hashed while written and fsynced when closed."""

    def __init__(self, real):
        self.real = real
        self.active = type(real).__name__ == "TorchCheckpointEngine"
        self.hashes: dict[str, dict] = {}

    def save(self, state_dict, path: str):
        self.hashes[path] = save_hashed(state_dict, path, zipfile=bool(getattr(self.real, "zipfile_serialization", False)))

    def __getattr__(self, name):
        return getattr(self.real, name)


class _Verifying:
    """Stands in for DeepSpeed's torch checkpoint engine during a load: each file DeepSpeed loads is read
    once on this rank, checked against the manifest (trainguard.checkpoint.manifest.VerifiedReader) and
    deserialised from those bytes -- never reopened by path after the check."""

    def __init__(self, real, reader):
        self.real, self.reader = real, reader

    def load(self, path, map_location=None):
        import io

        data = self.reader.read(path)
        return torch.load(io.BytesIO(data), map_location=map_location, weights_only=False)

    def __getattr__(self, name):
        return getattr(self.real, name)


@contextlib.contextmanager
def _verified_loads(eng, reader):
    """DeepSpeed's loads of this checkpoint go through ``_Verifying`` (its torch engine only; a universal
    checkpoint's converted files are not in the manifest and load as DeepSpeed reads them)."""
    real = eng.checkpoint_engine
    if reader is None or type(real).__name__ != "TorchCheckpointEngine":
        yield
        return
    eng.checkpoint_engine = _Verifying(real, reader)
    try:
        yield
    finally:
        eng.checkpoint_engine = real


class _Capture:
    """Stands in for DeepSpeed's checkpoint engine during an async save: ``save`` snapshots the
    state dict to host memory instead of writing it; everything else is the real engine's."""

    def __init__(self, real, snapshot):
        self._real, self._snapshot = real, snapshot
        self.writes: list = []

    def save(self, state_dict, path: str):
        self.writes.append((self._snapshot(state_dict), path))

    def commit(self, info):
        return True

    def __getattr__(self, name):
        return getattr(self._real, name)
