"""The commit of a staged checkpoint (rank 0, once every rank's files are written and hashed):
the files made durable, the manifest written last, the staged directory renamed into place (a
checkpoint saved again under the same tag replaces the old one only at that rename), ``latest``
updated. A crash at any point leaves the old checkpoint or the new one, never half of one."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from trainguard.checkpoint.fsio import atomic_write_text, fsync_dir, make_durable
from trainguard.checkpoint.layout import LATEST, STAGING, CheckpointLayout
from trainguard.checkpoint.manifest import Manifest


def commit_staged(root: Path, staging_root: Path, nonce: str, manifest: Manifest, key: bytes | None = None) -> Path:
    """Commit ``<staging_root>/<manifest.tag>`` as ``<root>/<manifest.tag>``; returns its path.
    ``key``: sign the manifest (trainguard.checkpoint.auth) before the rename."""
    tag = manifest.tag
    staged = staging_root / tag
    make_durable(staged)
    manifest.write(staged)
    if key is not None:
        from trainguard.checkpoint.auth import sign

        sign(staged, key)
    fsync_dir(staged)
    final = CheckpointLayout(root).tag_dir(tag)
    aside = root / STAGING / f"replaced.{nonce}"
    if final.exists():  # the same tag saved again: the old one goes aside first
        os.replace(final, aside)
    os.replace(staged, final)
    fsync_dir(root)
    atomic_write_text(root / LATEST, tag)
    shutil.rmtree(staging_root, ignore_errors=True)
    shutil.rmtree(aside, ignore_errors=True)
    return final
