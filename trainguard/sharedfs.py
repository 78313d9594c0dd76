"""Files in folders others may write (a shared log folder, /dev/shm): appends opened never through a planted link and
never into a FIFO or a device. (Atomic replacement, with an exclusive random temporary: trainguard.checkpoint.fsio.)"""
from __future__ import annotations

import os


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
