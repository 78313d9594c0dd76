"""The commit of a staged checkpoint (rank 0, once every rank's files are written and hashed):
the files made durable, the manifest written last, the staged directory renamed into place (a
checkpoint saved again under the same tag replaces the old one only at that rename), ``latest``
updated. A crash at any point leaves the old checkpoint or the new one, never half of one."""
from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path

from trainguard.checkpoint.fsio import PRIVATE_DIR_MODE, PRIVATE_FILE_MODE, atomic_write_text, fsync_dir, make_durable
from trainguard.checkpoint.layout import (LATEST, MANIFEST, STAGING, CheckpointLayout, StorageError, read_manifest,
                                         storage_error)
from trainguard.checkpoint.manifest import Manifest
from trainguard.checkpoint.signed import record_commit, staged_digest

# <root>/.staging is made by a save's staging and left by its commit -- in the training thread, or a background one's
# (checkpoint.async) --, and retention moves what it deletes through it: what makes it and what removes it take turns
STAGING_HELD = threading.Lock()


def beside_its_tags(staging_root: Path, root: Path, tag: str) -> None:
    """The framework's own files that its save writes beside the tag, not in it -- DeepSpeed's ``zero_to_fp32.py`` and
    ``zero_to_torch.py``, which a user runs to consolidate a ZeRO checkpoint --, moved to where the framework alone
    would have put them (regular files only; no manifest covers them, as none does in a plain DeepSpeed folder)."""
    import stat

    for extra in staging_root.iterdir():
        if extra.name != tag and not extra.name.startswith(".") and stat.S_ISREG(os.lstat(extra).st_mode):
            os.replace(extra, Path(root) / extra.name)


def leave_staging(root: Path) -> None:
    """After a commit: ``<root>/.staging`` goes once it is empty -- HF's ``checkpoint-N`` is a save root of its own, and
    an empty ``.staging`` left in every one is litter (issue 53). One still holding a save under way stays."""
    with STAGING_HELD:
        try:
            os.rmdir(Path(root) / STAGING)
        except OSError:  # (not empty: another save's staging, or a replaced copy not yet removed; or gone)
            pass


def as_written(staged: Path, hashed: dict, late: list | None = None) -> str | None:
    """Rank 0, before the commit: whether the staged folder holds the files the ranks wrote, at the sizes they wrote
    (``hashed``: the ranks' tables, hashed from the bytes as written). One swapped for another size is refused here;
    one of the same size fails its sha256 at every load, the signature binding the bytes as written. ``late``: a
    list to take the files no rank could hash while writing (a framework's writer that seeks back, a checkpoint
    engine other than torch's), hashed now from the folder -- the job's own, 0700 -- and added to ``hashed``;
    None: every file must be in the tables. Returns why the commit must not happen, or None."""
    from trainguard.checkpoint.manifest import hash_files, list_files

    files = list_files(staged)
    if late is not None:
        late += [f for f in files if f not in hashed]
        hashed.update(hash_files(staged, late))
    if set(hashed) != set(files):
        return f"{sorted(set(hashed) ^ set(files))[:5]} differ between what the ranks wrote and what is in {staged}"
    for rel, want in hashed.items():
        size = os.lstat(staged / rel).st_size
        if size != want["size"]:
            return f"{staged / rel}: {size} bytes, the rank wrote {want['size']}"
    return None


def commit_staged(root: Path, staging_root: Path, nonce: str, manifest: Manifest, key: bytes | None = None,
                  private: bool = False) -> Path:
    """Commit ``<staging_root>/<manifest.tag>`` as ``<root>/<manifest.tag>``; returns its path.
    ``key``: sign the manifest (trainguard.checkpoint.auth) before the rename. ``private``: files 0600 and
    folders 0700 whatever the umask (the in-memory tier, in memory other users of the node can reach)."""
    tag = manifest.tag
    staged = staging_root / tag
    modes = (PRIVATE_FILE_MODE, PRIVATE_DIR_MODE) if private else (None, None)
    make_durable(staged, *modes)
    manifest.write(staged)
    written = [MANIFEST]
    if key is not None:
        from trainguard.checkpoint.auth import SIGNATURE, sign

        sign(staged, key)
        written.append(SIGNATURE)
    if private:
        for name in written:
            os.chmod(staged / name, PRIVATE_FILE_MODE)
    fsync_dir(staged)
    digest = staged_digest(staged) if key is not None else None  # (hashed in the 0700 staging folder: what we wrote)
    final = CheckpointLayout(root).tag_dir(tag)
    aside = root / STAGING / f"replaced.{nonce}"
    if final.exists() and key is not None and read_manifest(final, key).why is not None:
        from trainguard.checkpoint.private import keep_aside  # (not this run's to delete: set aside, kept, said --

        kept = keep_aside(final, root / ".abandoned", f"{tag}.{nonce}")  # before the commit: a failure commits nothing)
        logging.getLogger("trainguard").warning("trainguard: %s held a checkpoint whose manifest does not verify with "
                                                "this run's key: moved to %s (kept), not deleted", final, kept)
    if final.exists():  # the same tag saved again: the old one goes aside first
        os.replace(final, aside)
    os.replace(staged, final)
    fsync_dir(root)
    record_commit(root, tag, key, digest)  # (with a key: what tells this commit from an older copy put back)
    atomic_write_text(root / LATEST, tag)
    beside_its_tags(staging_root, root, tag)
    shutil.rmtree(staging_root, ignore_errors=True)
    shutil.rmtree(aside, ignore_errors=True)
    leave_staging(root)
    return final


def restore_interrupted(root: Path) -> list[str]:
    """At start, before staging is cleared: a crash between the two renames of a re-save (the old
    copy moved aside, the new one not yet in place) left the tag in neither place -- put the old copy
    back (it was committed; the new one never was). Returns the tags put back."""
    import json

    restored = []
    staging = Path(root) / STAGING
    if not staging.is_dir():
        return restored
    for aside in sorted(staging.glob("replaced.*")):
        try:
            tag = json.loads((aside / "manifest.json").read_text())["tag"]
            final = CheckpointLayout(root).tag_dir(tag)
        except OSError as e:
            if storage_error(e):  # (the only copy of that tag: never cleared on a storage error)
                raise StorageError(aside / "manifest.json", e) from e
            continue
        except Exception:  # (not a committed checkpoint, or no valid tag: it stays staging, cleared)
            continue
        if not final.exists():
            os.replace(aside, final)
            restored.append(tag)
    if restored:
        fsync_dir(root)
        tags = CheckpointLayout(root).tags()
        if tags:
            atomic_write_text(Path(root) / LATEST, tags[-1])
    return restored
