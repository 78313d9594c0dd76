"""Folders only this user can write: where the in-memory tier keeps shards that DeepSpeed loads as pickles.

Node memory (``/dev/shm``) is shared by every user of the node. A folder there with a predictable name,
created with ``exist_ok`` and never checked, lets another user who creates it first (or swaps a
symlink in) place a pickled shard that the job then loads -- code run as the job's user. So every
folder from the configured ``snapshot.dir`` down is created 0700 by this user, or, where it exists,
checked with ``lstat`` (never following a link): a real folder, owned by this user, writable by no
one else. The folders above it (``/dev/shm`` itself) must be owned by root or this user and, where
others may write to them, sticky (no one can rename this user's folder away). A folder that fails is
refused by name, with what was found.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from trainguard.errors import TrainguardError

__all__ = ["UnsafeFolder", "private_dir", "own_dir", "expand"]


class UnsafeFolder(TrainguardError):
    """A folder the in-memory tier would write to (and load from) that another user can control."""


def expand(path: str | os.PathLike) -> Path:
    """The tier's own folder for a configured ``snapshot.dir``: ``{uid}`` becomes this user's id (the
    default is per user: ``/dev/shm/trainguard-{uid}``), and a shared sticky folder given as it is
    (``/dev/shm`` itself, a tmpfs mount point, mode 1777) gets a folder of this user's inside it."""
    uid = os.geteuid()
    p = Path(str(path).replace("{uid}", str(uid)))
    try:
        st = os.lstat(p)
    except OSError:
        return p
    if "{uid}" in str(path) and (stat.S_ISLNK(st.st_mode) or st.st_uid != uid):
        return _unsquatted(p, st)
    shared = stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX and st.st_mode & stat.S_IWOTH
    return p / f"trainguard-{uid}" if shared else p


def _unsquatted(p: Path, st: os.stat_result) -> Path:
    """The per-user name (``trainguard-{uid}``) taken by someone else first (another user's folder, a link): never a
    stop of the job -- a fresh folder of this process's own beside it (created 0700 under a random name, so it cannot
    be taken first), said in the log. Snapshots there do not outlive this process (a restart resumes from disk): the
    process holds a lock in it while it lives, and the next fallback removes this user's folders whose lock is free
    (their process is gone) -- so restarts do not fill node memory."""
    import logging
    import tempfile

    swept = _sweep(p)
    fresh = Path(tempfile.mkdtemp(prefix=f"{p.name}-", dir=p.parent))
    _hold(fresh)
    logging.getLogger("trainguard").warning(
        "trainguard: %s is not this user's (%s): another user took the name first; the in-memory tier uses %s "
        "instead (a fresh name of this process's: its snapshots do not outlive it)%s", p, _describe(st), fresh,
        f"; removed {len(swept)} left by processes gone" if swept else "")
    return fresh


_HELD: list[int] = []  # the lock files of this process's fallback folders, open and locked while it lives


def _hold(folder: Path) -> None:
    import fcntl

    fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    _HELD.append(fd)


def _sweep(p: Path) -> list[Path]:
    """This user's fallback folders beside ``p`` whose process is gone (their lock free), removed."""
    import fcntl
    import shutil

    gone = []
    for old in p.parent.glob(f"{p.name}-*"):
        try:
            st = os.lstat(old)
            if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                continue
            fd = os.open(old / ".lock", os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (held: its process lives -- another job's, kept)
            shutil.rmtree(old, ignore_errors=True)
            gone.append(old)
        except OSError:
            pass
        finally:
            os.close(fd)
    return gone


def _describe(st: os.stat_result) -> str:
    return f"owner uid {st.st_uid}, mode {stat.filemode(st.st_mode)}"


def _check_ancestor(p: Path, uid: int) -> None:
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        raise UnsafeFolder(f"{p} does not exist (the in-memory tier creates its own folder inside an existing one, "
                           "such as /dev/shm)") from None
    if stat.S_ISLNK(st.st_mode):
        if st.st_uid != 0:  # (a root-owned link such as /var/run -> /run is the system's)
            raise UnsafeFolder(f"{p} is a symlink owned by uid {st.st_uid}: another user could point it anywhere")
        st = os.stat(p)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeFolder(f"{p} is not a folder")
    if st.st_uid not in (0, uid):
        raise UnsafeFolder(f"{p} belongs to another user ({_describe(st)})")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        raise UnsafeFolder(f"{p} is writable by other users and not sticky ({_describe(st)}): they could rename "
                           "the folders below it")


def _check_own(p: Path, uid: int) -> None:
    st = os.lstat(p)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeFolder(f"{p} is a symlink: refused (the in-memory tier writes only into real folders it owns)")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeFolder(f"{p} is not a folder")
    if st.st_uid != uid:
        raise UnsafeFolder(f"{p} belongs to another user ({_describe(st)}): it may hold files they wrote; use a "
                           "folder of your own (snapshot.dir, default /dev/shm/trainguard-{uid})")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeFolder(f"{p} is writable by other users ({_describe(st)}): chmod go-w it, or use another folder")


def private_dir(base: str | os.PathLike, *below: str) -> Path:
    """``base/below...`` made safe to write and load from: every folder from ``base`` down created 0700 by
    this user where missing, checked where present; ``base``'s ancestors checked as the system's.
    Returns the deepest folder. Raises UnsafeFolder naming the first folder that fails."""
    uid = os.geteuid()
    base = Path(os.path.abspath(base))
    for anc in reversed(base.parents):
        _check_ancestor(anc, uid)
    p = base
    for part in ("", *below):
        p = p / part if part else p
        try:
            os.mkdir(p, 0o700)
            os.chmod(p, 0o700)  # (the umask may have taken bits away; never adds any)
        except FileExistsError:
            pass
        _check_own(p, uid)
    return p


def _aside(p: Path, st: os.stat_result) -> Path:
    """Something not this job's (a link, a file, another user's folder) where a folder of its own goes, inside a
    folder of the job's user's: renamed aside in that folder (a rename there needs only its write), said -- never a
    failed save. Returns ``p``, free again."""
    import logging
    import uuid

    aside = p.with_name(f"{p.name}.foreign.{uuid.uuid4().hex[:8]}")
    os.rename(p, aside)
    logging.getLogger("trainguard").warning("trainguard: %s was not this job's (%s): moved to %s, kept", p,
                                            _describe(st), aside)
    return p


def own_dir(path: str | os.PathLike, fresh: bool = False) -> Path:
    """A folder of this job's inside a checkpoint directory (its staging, a conversion's output): created 0700 where
    missing -- never through a symlink someone planted --, else checked with ``lstat`` to be a real folder of this
    user's; something else found there -- planted in a folder of the user's -- is moved aside first (said). ``fresh``:
    it must not exist yet (a name of this save's own: one found there was planted). The directory above it is the
    user's (``checkpoint.dir``, perhaps group-shared): only what trainguard writes into is made private. Raises
    UnsafeFolder naming the folder."""
    p = Path(path)
    try:
        os.mkdir(p, 0o700)
        os.chmod(p, 0o700)
        return p
    except FileExistsError:
        if fresh:
            raise UnsafeFolder(f"{p} exists already: a folder of this save's own name was made by someone else") from None
    st = os.lstat(p)
    foreign = stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid()
    up = os.lstat(p.parent)
    if foreign and up.st_uid == os.geteuid() and not up.st_mode & 0o022:  # (in a folder only ours: moved aside, kept)
        return own_dir(_aside(p, st), fresh=True)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UnsafeFolder(f"{p} is {'a symlink' if stat.S_ISLNK(st.st_mode) else 'not a folder'}: refused (trainguard "
                           "writes checkpoints only into real folders of its own)")
    if st.st_uid != os.geteuid():
        raise UnsafeFolder(f"{p} belongs to another user ({_describe(st)})")
    if st.st_mode & 0o077:
        os.chmod(p, 0o700)  # (one an older release made with the umask's mode: no one else may rename inside it)
    return p


def keep_aside(src: Path, into: str | os.PathLike, name: str) -> Path:
    """Move ``src`` (a tag folder not to be deleted) to ``into/name`` (a folder of this job's: own_dir), kept; another
    user's folder cannot change parents (a rename of a folder moves its ``..``): renamed where it is instead, to
    ``.name.foreign``. Returns where it went."""
    dest = own_dir(into) / name
    try:
        os.replace(src, dest)
    except PermissionError:
        dest = src.parent / f".{name}.foreign"
        os.replace(src, dest)
    return dest
