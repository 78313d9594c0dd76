"""What a rank loads from a checkpoint, checked on that rank from the bytes it loads (VerifiedReader), against the
manifest rank 0 verified (pinned by its digest, ``manifest_digest``)."""
from __future__ import annotations

import json
import os
from pathlib import Path

from trainguard.checkpoint.layout import MANIFEST, read_regular
from trainguard.checkpoint.manifest import inside


def manifest_digest(tag_dir: str | os.PathLike) -> str | None:
    """sha256 of a checkpoint's manifest bytes (what rank 0 verified, so every rank can pin the same one)."""
    import hashlib

    try:
        return hashlib.sha256((Path(tag_dir) / MANIFEST).read_bytes()).hexdigest()
    except OSError:
        return None


class VerifiedReader:
    """What a rank loads from a checkpoint, checked on that rank, from the bytes it loads.

    Rank 0 verifies a checkpoint when it chooses it; the other ranks -- and rank 0 itself -- then open the
    files by path later, and a swap in between would go unseen. So each rank reads the manifest once
    (pinned to the digest of the one rank 0 verified, and with a key, its signature checked on those same
    bytes), then reads every file it loads into memory once, compares size and sha256 with the manifest,
    and only then hands the bytes to the deserialiser -- never the path."""

    def __init__(self, tag_dir: str | os.PathLike, digest: str | None = None, key: bytes | None = None):
        import hashlib
        import hmac

        from trainguard.checkpoint.layout import CheckpointError

        self.tag_dir = Path(os.path.abspath(tag_dir))
        raw = read_regular(self.tag_dir / MANIFEST)
        if digest is not None and hashlib.sha256(raw).hexdigest() != digest:
            raise CheckpointError(f"{self.tag_dir / MANIFEST} changed since it was verified (its sha256 differs "
                                  "from the one rank 0 checked): refused")
        if key is not None:
            from trainguard.checkpoint.auth import SIGNATURE, signature_of

            stored = read_regular(self.tag_dir / SIGNATURE).strip()
            if not hmac.compare_digest(stored, signature_of(raw, key).encode()):
                raise CheckpointError(f"{self.tag_dir / SIGNATURE}: HMAC mismatch on the manifest this rank read")
        from trainguard.checkpoint.manifest import Manifest

        self.digest = hashlib.sha256(raw).hexdigest()
        self.manifest = Manifest.parse(json.loads(raw))  # (the bytes checked above: never read again)
        self.files: dict[str, dict] = self.manifest.files
        self.read_files: list[str] = []

    def read(self, path: str | os.PathLike) -> bytes:
        """The bytes of ``path`` (a file of this checkpoint), after they matched the manifest."""
        import hashlib

        from trainguard.checkpoint.layout import CheckpointError

        rel = os.path.relpath(os.path.abspath(path), self.tag_dir)
        want = self.files.get(rel) if inside(rel) else None
        if want is None:
            raise CheckpointError(f"{path}: not listed in the manifest of {self.tag_dir}: refused, never read")
        data = read_regular(Path(path), max_bytes=int(want["size"]))  # (no more than the manifest says it holds)
        from trainguard.checkpoint.fsio import progressed

        progressed()
        if len(data) != int(want["size"]) or hashlib.sha256(data).hexdigest() != want["sha256"]:
            raise CheckpointError(f"{path}: its bytes differ from the manifest's sha256 (changed since it was "
                                  "verified): refused, never deserialised")
        self.read_files.append(rel)
        return data


