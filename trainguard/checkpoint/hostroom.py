"""Whether a node's memory can hold an asynchronous save's host copies, before they are made.

An asynchronous save (``checkpoint.async``, and the first step's insurance whatever it says) copies each rank's
state to host memory and writes it in the background. Every rank of a node copies at once: on a node whose memory
cannot hold them, the copies would take the memory the data loaders, NCCL's shared-memory transport and the
processes themselves need, and the kernel's OOM killer would end a run its framework's synchronous save keeps
alive. So the save asks first, from what the node says is available to this job -- ``MemAvailable`` in
``/proc/meminfo`` and, where the job runs in a cgroup (Slurm, Kubernetes, Docker), the cgroup's limit less its use
-- and where the copies would not fit with a margin, the save is written synchronously instead (the framework's
own way, tensor by tensor: nothing held at once) and says why.

A load of trainguard's own files has the same shape the other way: each rank reads a file's bytes, then its tensors
(about twice the file at once), and on a restart from the first step's checkpoint every data-parallel replica reads the
weights the first of them wrote -- on a node of 8 replicas, 16 states in host memory at once. Where some node cannot hold
that, the ranks of each node take turns (:func:`by_turns`).
"""
from __future__ import annotations

import socket
from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")

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


def _stat(path: Path, key: str) -> int:
    """A field of a cgroup's memory.stat (0 where absent)."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def _cgroup_room(root: Path = _CGROUP, rel: str | None = None) -> int | None:
    """What the job's cgroups leave: for this process's cgroup and each one above it (a Slurm job's limit sits on
    the job, not on its step's task), its limit less what it uses, the page cache it can drop not counted (v2:
    memory.max / memory.current / inactive_file; v1: memory.limit_in_bytes / usage_in_bytes / total_inactive_file);
    the smallest, or None where no cgroup sets a limit."""
    if rel is None:
        rel = ""
        try:
            for line in Path("/proc/self/cgroup").read_text().splitlines():
                parts = line.split(":", 2)
                if len(parts) == 3 and (parts[0] == "0" or "memory" in parts[1].split(",")):
                    rel = parts[2].strip("/")
                    break
        except OSError:
            pass
    parts = [p for p in rel.split("/") if p]
    rooms = []
    for base in (root, root / "memory"):
        for depth in range(len(parts), -1, -1):
            d = base.joinpath(*parts[:depth])
            for limit_f, used_f, cache in (("memory.max", "memory.current", "inactive_file"),
                                          ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")):
                limit, used = _read_int(d / limit_f), _read_int(d / used_f)
                if limit is not None and used is not None and limit < (1 << 60):  # (v1's "no limit": a huge number)
                    rooms.append(max(0, limit - max(0, used - _stat(d / "memory.stat", cache))))
    return min(rooms) if rooms else None


def available() -> int | None:
    """Bytes this node can still give this job (the smaller of the two), or None where it does not say."""
    known = [b for b in (_meminfo(), _cgroup_room()) if b is not None]
    return min(known) if known else None


def refusal(need: int | None, ranks: int, have: int | None = None) -> str | None:
    """Why host copies of ``need`` bytes in all, by ``ranks`` ranks of this node, would not fit its memory (``have``:
    what it has; default :func:`available`), or None where they would -- or where nothing says."""
    if not need:
        return None
    have = available() if have is None else have
    if have is None or need <= have * MARGIN:
        return None
    return (f"its host copies (about {_gb(need)} by this node's {ranks} rank(s)) would take more than "
            f"{int(MARGIN * 100)}% of the {_gb(have)} this node has available")


def node_refusal(each: int, gather) -> str | None:
    """Every rank: :func:`refusal` of this node, its ranks' copies summed (``gather``: every rank's object, in rank
    order -- the launcher's local-size variables differ from one launcher to the next; a host name does not)."""
    here = socket.gethostname()
    mine = [n for host, n in gather((here, each)) if host == here]
    return refusal(sum(mine), len(mine))


def by_turns(each: int, load: Callable[[], T]) -> T:
    """Every rank, together: ``load()``, which holds about ``each`` bytes of host memory while it runs. Where the ranks of
    some node would not fit its memory all at once (:func:`refusal`, on what each node says it has -- every rank judges
    every node from one gather, so all take the same way), the ranks of each node load one after another, a barrier
    between turns (as many on every rank: a load that fails waits its turns out, then raises); else all at once."""
    from trainguard.ranks.isolation import gather_objects, rank

    here = socket.gethostname()
    seen = gather_objects((here, int(each or 0), available()))
    nodes: dict[str, list] = {}
    for host, n, have in seen:
        node = nodes.setdefault(host, [0, 0, have])
        node[0], node[1] = node[0] + n, node[1] + 1
    if not any(have is not None and refusal(need, ranks, have) for need, ranks, have in nodes.values()):
        return load()
    import torch.distributed as dist

    mine = [r for r, (host, _, _) in enumerate(seen) if host == here].index(rank())
    result, error = None, None
    for turn in range(max(ranks for _, ranks, _ in nodes.values())):
        if turn == mine:
            try:
                result = load()
            except BaseException as e:  # noqa: BLE001 - (raised after the turns: the others wait at each barrier)
                error = e
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
    if error is not None:
        raise error
    return result


def _gb(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"
