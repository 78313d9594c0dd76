"""Files in folders others may write (a shared log folder, /dev/shm): appends opened never through a planted link and
never into a FIFO or a device; a folder of the job's own, checked; a file of the job's own, read. (Atomic replacement,
with an exclusive random temporary: trainguard.checkpoint.fsio.)"""
from __future__ import annotations

import os
from pathlib import Path


def open_append(path: str | os.PathLike, binary: bool = False, mode: int = 0o666):
    """``path`` opened for appending (created with ``mode`` less the umask when missing) -- never through a symlink someone
    planted in a folder others may write (O_NOFOLLOW), never a FIFO or a device (an OSError names it)."""
    import stat

    def opener(name, flags):
        fd = os.open(name, flags | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0), mode)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(f"{name}: not a regular file: refused (a log or marker is appended to regular files only)")
        return fd

    return open(path, "ab" if binary else "a", **({} if binary else {"encoding": "utf-8"}), opener=opener)


def open_log(path: str | os.PathLike, binary: bool = False):
    """``(file, its path)``: :func:`open_append` of ``path``, or -- a folder, link or FIFO planted there by someone who
    may write the folder -- a fresh file of this process's own beside it, said in the log: a log is never what stops a
    run (nor what keeps a hang from its requeue)."""
    try:
        return open_append(path, binary), str(path)
    except OSError as e:
        import logging
        import tempfile

        fd, alt = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=f"{os.path.basename(path)}.")
        logging.getLogger("trainguard").warning("trainguard: %s cannot be appended to (%s): %s instead", path, e, alt)
        return open(alt, "ab" if binary else "a", **({} if binary else {"encoding": "utf-8"}),  # (its name: alt)
                    opener=lambda *_: fd), alt


def own_folder(path: str | os.PathLike, key: str) -> None:
    """``path`` (``key`` names the setting) as a folder only this user writes: created 0700 when missing; one of this
    user's that others may write is made 0700; a link, a file, another user's folder, or one inside a folder others
    may write that is not sticky, is refused (ConfigError naming ``key``) -- what is read from it decides (a
    heartbeat there can stop every rank)."""
    import stat

    from trainguard.errors import ConfigError

    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except FileExistsError:  # (a file there: said below)
        pass
    st = os.lstat(path)
    above = [os.stat(a) for a in Path(os.path.abspath(path)).parents]  # (every folder above: none may be renamed)
    what = "a link" if stat.S_ISLNK(st.st_mode) else "not a folder" if not stat.S_ISDIR(st.st_mode) else \
        "another user's folder" if st.st_uid != os.geteuid() else \
        "below a folder others may write and not sticky, or another user's (they could rename it away and back)" if any(
            (a.st_mode & 0o022 and not a.st_mode & stat.S_ISVTX) or a.st_uid not in (0, os.geteuid()) for a in above
        ) else None
    if what is not None:
        raise ConfigError([(key, f"{path} is {what}: give a folder of this job's user's own")])
    if st.st_mode & 0o022:
        os.chmod(path, 0o700)


def read_own(path: str | os.PathLike) -> str | None:
    """The text of ``path`` when it is a regular file of this user's (opened without following a link, never a FIFO);
    None otherwise -- a file someone else put there is not read."""
    import stat

    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return None
        return f.read(1 << 20).decode("utf-8", "replace")


def tail_lines(path: str | os.PathLike, nbytes: int) -> list[bytes]:
    """The lines of the last ``nbytes`` of a log a writer of its folder may reach: opened without following a link,
    never blocking on a FIFO planted in its place. Raises OSError (a caller that cannot read it knows nothing)."""
    with open(path, "rb", opener=lambda p, fl: os.open(p, fl | os.O_NOFOLLOW | os.O_NONBLOCK)) as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - nbytes))
        return f.read().splitlines()
