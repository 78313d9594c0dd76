"""Whether a node's memory can hold an asynchronous save's host copies, before they are made.

An asynchronous save (``checkpoint.async``, and the first step's insurance whatever it says) copies each rank's
state to host memory and writes it in the background. Every rank of a node copies at once: on a node whose memory
cannot hold them, the copies would take the memory the data loaders, NCCL's shared-memory transport and the
processes themselves need, and the kernel's OOM killer would end a run its framework's synchronous save keeps
alive. So the save asks first, from what the node says is available to this job -- ``MemAvailable`` in
``/proc/meminfo`` and, where the job runs in a cgroup (Slurm, Kubernetes, Docker), the cgroup's limit less its use
-- and where the copies would not fit with a margin, the save is written synchronously instead (the framework's
own way, tensor by tensor: nothing held at once) and says why.
"""
from __future__ import annotations

import os
from pathlib import Path

MARGIN = 0.75  # of what is available: the copies may take at most this share (the rest: loaders, NCCL, the processes)

_CGROUP = Path("/sys/fs/cgroup")


def _meminfo(path: Path = Path("/proc/meminfo")) -> int | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _read_int(path: Path) -> int | None:
    try:
        raw = path.read_text().strip()
    except OSError:
        return None
    return int(raw) if raw.isdigit() else None  # ("max": no limit)


def _cgroup_room(root: Path = _CGROUP) -> int | None:
    """The job's cgroup's limit less its use (v2: memory.max/memory.current; v1: memory.limit_in_bytes/usage), of
    this process's own cgroup where /proc/self/cgroup names it; None where there is no limit."""
    rel = ""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            parts = line.split(":", 2)
            if len(parts) == 3 and (parts[0] == "0" or "memory" in parts[1].split(",")):
                rel = parts[2].lstrip("/")
                break
    except OSError:
        pass
    for base in ([root / rel, root] if rel else [root]) + [root / "memory" / rel, root / "memory"]:
        for limit_f, used_f in (("memory.max", "memory.current"), ("memory.limit_in_bytes", "memory.usage_in_bytes")):
            limit, used = _read_int(base / limit_f), _read_int(base / used_f)
            if limit is not None and used is not None and limit < (1 << 60):  # (v1's "no limit" is a huge number)
                return max(0, limit - used)
    return None


def available() -> int | None:
    """Bytes this node can still give this job (the smaller of the two), or None where it does not say."""
    known = [b for b in (_meminfo(), _cgroup_room()) if b is not None]
    return min(known) if known else None


def local_ranks() -> int:
    """The ranks on this node (torchrun's LOCAL_WORLD_SIZE, Slurm's SLURM_NTASKS_PER_NODE; else 1)."""
    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        raw = os.environ.get(key, "").split("(")[0]
        if raw.isdigit() and int(raw) > 0:
            return int(raw)
    return 1


def refusal(each: int | None, ranks: int | None = None, have: int | None = None) -> str | None:
    """Why host copies of about ``each`` bytes on each of ``ranks`` ranks of this node would not fit its memory
    (``have``: what it has; default :func:`available`), or None where they would -- or where nothing says."""
    if not each:
        return None
    ranks = local_ranks() if ranks is None else ranks
    have = available() if have is None else have
    if have is None:
        return None
    need = each * ranks
    if need <= have * MARGIN:
        return None
    return (f"its host copies (about {_gb(each)} on each of {ranks} rank(s) of this node, {_gb(need)} in all) would "
            f"take more than {int(MARGIN * 100)}% of the {_gb(have)} this node has available")


def _gb(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"
