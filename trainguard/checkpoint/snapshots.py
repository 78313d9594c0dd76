"""The in-memory snapshot tier (framework-free part): where each rank's shard lives, which snapshot
every rank can come back to, and the copies that travel between nodes.

Every ``snapshot.every_steps`` steps each rank copies its *own* shard of the full state to host memory
(the blocking part, in the adapter) and a background thread writes it into node-local shared memory
(``snapshot.dir``, a tmpfs: it outlives the process, not the node), as a checkpoint directory of that
rank alone -- files hashed while written, a manifest written last, renamed into place
(trainguard.checkpoint.commit). So no collective runs on the step, and a restarted process finds its
shard where it left it. With ``peer_copy``, the same thread then sends the committed shard to a rank
on the next node, which keeps it in its own node's memory: a node that is lost with its memory comes
back from those copies.

Layout, under ``<snapshot.dir>/<run id>/`` (the run id is kept in ``checkpoint.dir``: a new run, or
another job on the node, never sees these snapshots)::

    node<n>/rank<r>/<tag>/...          rank r's own shard (a checkpoint root of its own)
    node<n>/held-rank<q>/<tag>/...     the copy of rank q's shard that a rank of node n keeps

Choosing (every rank, at a resume or a rollback): each rank lists what verifies in its node's memory
(:func:`survey`), the lists are gathered, and :func:`common_choice` takes the newest snapshot that
*every* rank can load -- from its own shard, or from the copy its peer holds, which is then sent back
(``fetch``). A snapshot that one rank lacks is no snapshot of the run.
"""
from __future__ import annotations

import os
import shutil
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path

from trainguard.checkpoint import packed_shard
from trainguard.checkpoint.commit import commit_staged, restore_interrupted
from trainguard.checkpoint.layout import STAGING, CheckpointLayout
from trainguard.checkpoint.manifest import Manifest, verify
from trainguard.checkpoint.packed_shard import MAGIC  # noqa: F401 - (its name here: tests/unit/test_snapshots.py)

MEMORY = "memory:"           # how a snapshot's tag reads in choices and records (never a valid disk tag)


def memory_tag(tag: str) -> str:
    return MEMORY + tag


def disk_tag(tag: str) -> tuple[str, bool]:
    """``(tag, from_memory)`` of a tag as :func:`memory_tag` may have written it."""
    return (tag[len(MEMORY):], True) if tag.startswith(MEMORY) else (tag, False)


def snapshot_step(tag: str) -> int:
    """The step of a snapshot's tag (snapshots are always tagged ``step_tag(step)``)."""
    return int(disk_tag(tag)[0][len("step"):])


@dataclass(frozen=True)
class Placement:
    """Which node each rank is on, and who keeps whose copy."""

    rank: int
    node_of: tuple[int, ...]          # node index of every rank

    @classmethod
    def build(cls, rank: int, hosts: list[str], ranks_per_node: int | None = None) -> "Placement":
        if ranks_per_node:
            return cls(rank, tuple(r // ranks_per_node for r in range(len(hosts))))
        order: dict[str, int] = {}
        return cls(rank, tuple(order.setdefault(h, len(order)) for h in hosts))

    @staticmethod
    def host() -> str:
        return socket.gethostname()

    @property
    def world(self) -> int:
        return len(self.node_of)

    @property
    def node(self) -> int:
        return self.node_of[self.rank]

    def ranks_on(self, node: int) -> list[int]:
        return [r for r, n in enumerate(self.node_of) if n == node]

    def peer(self, r: int) -> int | None:
        """The rank on the next node that keeps rank ``r``'s copy (None: the job is on one node)."""
        nodes = sorted(set(self.node_of))
        if len(nodes) < 2:
            return None
        mine = self.ranks_on(self.node_of[r])
        there = self.ranks_on(nodes[(nodes.index(self.node_of[r]) + 1) % len(nodes)])
        return there[mine.index(r) % len(there)]

    def sources(self, r: int | None = None) -> list[int]:
        """The ranks whose copies rank ``r`` (this one) keeps."""
        r = self.rank if r is None else r
        return [q for q in range(self.world) if self.peer(q) == r]


class SnapshotStore:
    """One rank's view of its node's snapshot memory."""

    def __init__(self, base: str | os.PathLike, placement: Placement, keep: int, key: bytes | None = None):
        self.base = Path(base)
        self.place = placement
        self.keep = keep
        self.key = key

    def node_dir(self, node: int | None = None) -> Path:
        return self.base / f"node{self.place.node if node is None else node}"

    @property
    def own(self) -> Path:
        """This rank's shards: a checkpoint root of its own (DeepSpeed loads from it)."""
        return self.node_dir() / f"rank{self.place.rank}"

    def held(self, q: int) -> Path:
        return self.node_dir() / f"held-rank{q}"

    # ------------------------------------------------------------------ writing (the background thread)
    def commit(self, root: Path, staging_root: Path, nonce: str, manifest: Manifest) -> Path:
        """Commit a staged shard into ``root``, then keep only the newest ``keep`` there."""
        final = commit_staged(root, staging_root, nonce, manifest, key=self.key, private=True)
        self.prune(root)
        return final

    def prune(self, root: Path, keep: int | None = None) -> None:
        layout = CheckpointLayout(root)
        steps = layout.steps()
        for tag, _ in steps[:max(0, len(steps) - (self.keep if keep is None else keep))]:
            _remove(layout.tag_dir(tag), root)

    def drop_after(self, step: int) -> list[str]:
        """After a rollback to ``step``: shards of the abandoned trajectory go (own and held alike)."""
        dropped = []
        for root in [self.own, *(self.held(q) for q in self.place.sources())]:
            layout = CheckpointLayout(root)
            for tag, saved_at in layout.steps():
                if saved_at > step:
                    _remove(layout.tag_dir(tag), root)
                    if root == self.own:
                        dropped.append(tag)
        return dropped

    def drop_before(self, step: int) -> None:
        """Shards that no longer fit the engine (a precision change) go."""
        for root in [self.own, *(self.held(q) for q in self.place.sources())]:
            layout = CheckpointLayout(root)
            for tag, saved_at in layout.steps():
                if saved_at < step:
                    _remove(layout.tag_dir(tag), root)

    def clear_staging(self) -> None:
        """At start: shards a killed writer left half-written (never committed) are freed."""
        for root in [self.own, *(self.held(q) for q in self.place.sources())]:
            restore_interrupted(root)  # (a shard the writer was replacing under its tag: the old one back)
            shutil.rmtree(root / STAGING, ignore_errors=True)

    def clear(self) -> None:
        """The end of the run: this rank's memory is freed (its shards and the copies it keeps)."""
        for root in [self.own, *(self.held(q) for q in self.place.sources())]:
            shutil.rmtree(root, ignore_errors=True)
        try:
            self.node_dir().rmdir()
            self.base.rmdir()
        except OSError:
            pass

    def room(self, shard: int, peer_copy: bool = True) -> str | None:
        """Whether node memory can hold what the tier keeps on this node -- every rank's ``keep`` shards and the
        one being written, plus the peers' copies kept here -- for shards of about ``shard`` bytes; None, or
        why not with the figures. Node memory is shared with the data loaders' workers and NCCL's
        shared-memory transport, which fail when it is full (Docker's default /dev/shm is 64 MB)."""
        mine = self.place.ranks_on(self.place.node)
        held = sum(len(self.place.sources(r)) for r in mine) if peer_copy else 0
        need = (len(mine) * (self.keep + 1) + held * self.keep) * shard
        have = shutil.disk_usage(self.base.parent).free + self.bytes_used()
        if need <= have:
            return None
        return (f"node memory {self.base.parent} has {_mb(have)} free and the tier needs about {_mb(need)} on this "
                f"node ({len(mine)} rank(s) x (keep {self.keep} + 1 being written) + {held} peer copies x keep, of a "
                f"shard of about {_mb(shard)}): lower snapshot.keep, make the tmpfs larger (docker run --shm-size), or "
                "set snapshot.every_steps to 0")

    def bytes_used(self) -> int:
        """Host memory this rank's snapshots take on its node (its shards and the copies it keeps)."""
        total = 0
        for root in [self.own, *(self.held(q) for q in self.place.sources())]:
            for dirpath, _, names in os.walk(root):
                total += sum(os.path.getsize(os.path.join(dirpath, n)) for n in names)
        return total

    # ------------------------------------------------------------------ peer copies (.packed_shard)
    def pack(self, tag: str, root: Path | None = None) -> bytes:
        """The committed shard ``tag`` (of ``root``: this rank's own by default) as one message in a plain
        format, never a pickle (:func:`trainguard.checkpoint.packed_shard.pack`)."""
        return packed_shard.pack(CheckpointLayout(self.own if root is None else root).tag_dir(tag), tag)

    def unpack(self, payload: bytes, root: Path) -> str:
        """Write a packed shard into ``root`` under the commit protocol, verified before it becomes visible
        (:func:`trainguard.checkpoint.packed_shard.unpack`: ValueError, nothing left behind, when it is malformed
        or does not verify), then keep only the newest ``keep`` there."""
        tag = packed_shard.unpack(payload, root, self.key)
        self.prune(root)
        return tag

    # ------------------------------------------------------------------ choosing
    def survey(self, world: int, fits: dict | None = None) -> dict:
        """What verifies in this node's memory for this rank: its own shards and the copies it keeps
        (those of a job of ``world`` ranks, and whose manifest layout has every value of ``fits``: a shard
        is one rank's partition of that layout)."""
        refused: list[dict] = []  # what failed verification: rot, or bytes someone else changed (named, never loaded)
        return {"own": _valid(self.own, self.key, world, fits, refused),
                "held": {q: _valid(self.held(q), self.key, world, fits, refused) for q in self.place.sources()},
                "refused": refused}


def common_choice(table: list[dict], place: Placement, lo: int = 0, hi: float = float("inf"),
                  only: set[str] | None = None) -> tuple[str, int, list[tuple[int, int]]] | None:
    """The newest snapshot (``lo <= step < hi``; a tag in ``only`` if given) that every rank can load: from
    its own shard, or from the copy its peer keeps. Returns ``(tag, step, [(rank, holder) to fetch])`` or None.
    ``table``: every rank's :meth:`SnapshotStore.survey`, in rank order."""
    own = [{tuple(t) for t in row["own"]} for row in table]
    held = [{q: {tuple(t) for t in kept} for q, kept in row["held"].items()} for row in table]
    for tag, step in sorted(set().union(*own), key=lambda t: t[1], reverse=True):
        if not lo <= step < hi or (only is not None and tag not in only):
            continue
        fetch = []
        for r in range(len(table)):
            if (tag, step) in own[r]:
                continue
            holder = place.peer(r)
            if holder is None or (tag, step) not in held[holder].get(r, ()):
                break
            fetch.append((r, holder))
        else:
            return tag, step, fetch
    return None


def _mb(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _valid(root: Path, key: bytes | None, world: int, fits: dict | None = None,
           refused: list | None = None) -> list[tuple[str, int]]:
    """The shards under ``root`` that verify (with ``key``: signed) and fit the layout; the others that do not
    verify go into ``refused`` with why."""
    layout = CheckpointLayout(root)
    out = []
    want = {"world": world, **(fits or {})}
    for tag, step in layout.steps():
        tag_dir = layout.tag_dir(tag)
        res = verify(tag_dir, key=key)
        if not res.ok:
            if refused is not None:
                refused.append({"tag": tag, "dir": str(root), "bad_file": res.bad_file, "reason": res.reason})
            continue
        saved = res.manifest.layout  # (the manifest verify read: never read again)
        if all(saved.get(k) == v for k, v in want.items()):
            out.append((tag, step))
    return out


def _remove(tag_dir: Path, root: Path) -> None:
    """Out of the listing at once (renamed into staging), then deleted."""
    trash = root / STAGING / f"deleted.{tag_dir.name}.{uuid.uuid4().hex[:6]}"
    trash.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tag_dir, trash)
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)
