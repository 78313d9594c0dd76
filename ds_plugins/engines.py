"""Stand-ins for DeepSpeed's checkpoint engine while trainguard saves and loads: each file hashed as it is written
(a synchronous save) or captured to host memory (an async save, the in-memory tier). (A load reads through
trainguard.checkpoint.verified_io: each file read once and checked against the verified manifest first.)"""
from __future__ import annotations

from trainguard.ports import save_hashed


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
