"""The in-memory snapshot tier (``checkpoint.snapshot``), for every adapter: each rank's own shard to node
memory every few steps with no collective on the step, a background writer that hashes and commits it, and
a copy to a rank on the next node (trainguard/checkpoint/snapshots.py holds the store and the placement).

What a shard *is* belongs to the framework: the adapter hands a :class:`trainguard.protocols.ShardSource`, whose ``capture``
builds this rank's state as host copies (the blocking part); everything else -- the private folder and
its space check, pacing, the writer thread, the peer exchange on a group of its own with a timeout,
failures escalating to ``snapshots_off``, choosing the newest snapshot every rank can load, fetching a
peer copy -- is here. Loading a shard is the adapter's again (its own load from ``store.own``).
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import threading
import time
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist

from trainguard.checkpoint.async_writer import snapshot as host_copy
from trainguard.checkpoint.fsio import save_buffered, write_json_hashed
from trainguard.checkpoint.layout import GUARD_STATE, SIDECAR, CheckpointLayout, step_tag
from trainguard.checkpoint.private import UnsafeFolder, expand, private_dir
from trainguard.checkpoint.runid import agreed_run_id
from trainguard.checkpoint.snapshots import Placement, SnapshotStore, common_choice
from trainguard.errors import ConfigError
from trainguard.events import Record
from trainguard.ranks.isolation import gather_objects, maxima, rank as _rank
from trainguard.protocols import ShardSource

__all__ = ["MemoryTier", "ShardSource", "MAX_FAILURES", "PEER_TIMEOUT_S"]  # (ShardSource: trainguard.protocols)

MAX_FAILURES = 3       # snapshots in a row that fail to write before the tier stops writing on that rank
PEER_TIMEOUT_S = 300.0  # the peer copies' group: a send or receive that takes longer fails (a dead peer)


class MemoryTier:
    """Built on every rank together (at the guard's start): the run's folder, the node map, the peers' group.
    ``cp``: the checkpoint manager (trainguard.checkpoint.manager.CheckpointManager) it reports through."""

    def __init__(self, cp, source: ShardSource):
        self.cp = cp
        self.source = source
        self.cfg = cp.cfg.snapshot
        why = source.unsupported()
        if why:
            raise ConfigError([("trainguard.checkpoint.snapshot.every_steps", f"the in-memory tier is not supported "
                               f"here: {why}; set it to 0 (disk checkpoints still work)")])
        rid = agreed_run_id(cp.cfg.dir)
        place = Placement.build(_rank(), gather_objects(Placement.host()), self.cfg.ranks_per_node)
        base = expand(self.cfg.dir)
        self.store = SnapshotStore(base / rid, place, self.cfg.keep, key=cp.key)
        problem = None
        try:  # only folders this user owns and no one else can write: shards are pickles (private.py)
            private_dir(base, rid, self.store.node_dir().name, self.store.own.name)
            self.store.clear_staging()  # what a killed writer left half-written
        except UnsafeFolder as e:
            problem = f"rank {_rank()}: {e}"
        except OSError as e:
            problem = f"rank {_rank()} cannot write to {self.store.own}: {e}"
        if problem is None:
            problem = self.store.room(source.estimated_bytes(), peer_copy=self.cfg.peer_copy)
        problems = [p for p in gather_objects(problem) if p]  # (every rank stops, not only the one that failed)
        if problems:
            raise ConfigError([("trainguard.checkpoint.snapshot.dir", f"{'; '.join(problems)}; expected a node-local "
                               "directory (a tmpfs such as /dev/shm) every rank can write and no other user can")])
        spans_nodes = len(set(place.node_of)) > 1
        self.peer = place.peer(place.rank) if self.cfg.peer_copy else None
        self.sources = place.sources() if self.cfg.peer_copy else []
        # the copies travel on a group of their own: the writer thread never meets the loop's collectives
        # and with a timeout of their own: a dead peer fails the copy (checkpoint_failed) instead of parking the
        # writer -- and, at the next snapshot, the step -- for the default 30 minutes
        timeout = timedelta(seconds=min(PEER_TIMEOUT_S, cp.block.distributed.collective_timeout_s or PEER_TIMEOUT_S))
        self.group = dist.new_group(backend="gloo", timeout=timeout) if self.cfg.peer_copy and spans_nodes else None
        self._job: _Job | None = None
        self._fetch: dict[str, list] = {}
        self.failures = 0                     # snapshots in a row whose write failed on this rank
        self.off: str | None = None           # why this rank's tier stopped writing (it keeps the schedule)

    # ------------------------------------------------------------------ taking one (every rank, no collective)
    def take(self) -> str:
        t0 = time.perf_counter()
        self.wait()  # (a writer still busy holds the step up: part of this one's blocking time)
        if self.off is not None:
            return self._take_nothing(t0)
        step = self.source.step()
        interval = self._pace(step)
        tag = step_tag(step)
        nonce = f"{tag}.{uuid.uuid4().hex[:8]}"
        staging_root = CheckpointLayout(self.store.own).staging_root(nonce)
        try:
            staging_root.mkdir(parents=True, exist_ok=True)
            staged = staging_root / tag
            writes = list(self.source.capture(staging_root, tag, step))
            saver = self.cp.saver  # (trainguard's own parts: the same as a disk checkpoint's)
            writes.append((host_copy(saver.sidecar()), staged / SIDECAR / f"rank{_rank()}.pt"))
            json_writes = [(self.cp.guard.state_dict(), staged / SIDECAR / GUARD_STATE)] if self.cp.guard else []
            manifest = saver.manifest(tag, step, {}, health=saver.note_loss(step), tier="memory")
        except OSError as e:  # node memory full already here: a failed snapshot, never a failed step
            shutil.rmtree(staging_root, ignore_errors=True)
            return self._no_write(tag, step, t0, interval, failed=e)
        blocking = time.perf_counter() - t0
        self.cp.overhead(blocking)
        self._job = _Job(self, tag, step, staged, staging_root, nonce, writes, json_writes, manifest, blocking, interval,
                         dies=self.cp.faults is not None and self.cp.faults.dies_writing(step))
        return tag

    def _take_nothing(self, t0: float) -> None:
        """The tier is off on this rank: the schedule is kept (the pace's all-gather, an empty message to the
        peer, which waits for one), nothing is copied or written."""
        step = self.source.step()
        return self._no_write(step_tag(step), step, t0, self._pace(step))

    def _no_write(self, tag: str, step: int, t0: float, interval: int, failed: BaseException | None = None) -> None:
        """A snapshot step with nothing to write (the tier off here, or its blocking part failed: ``failed``): only
        the writer's peer exchange runs, and poll() reports the failure."""
        self._job = _Job(self, tag, step, None, None, None, [], [], None, time.perf_counter() - t0, interval,
                         off=True, failed=failed)
        return None

    def _pace(self, step: int) -> int:
        """With a cost budget (``snapshot.max_overhead``): what the previous snapshot cost training and the
        mean step, agreed by every rank (the largest cost, the shortest step), set the interval to
        the next one (trainguard.checkpoint.pacing). Returns the interval."""
        pacer = self.cp.pacer
        if not pacer.paced:
            return pacer.taken(step)
        mine = pacer.figures()  # (cost, mean step) or None; one all-reduce of three numbers, whatever the world
        missing, cost, neg_step = maxima([1.0, 0.0, 0.0] if mine is None else [0.0, mine[0], -mine[1]])
        if missing:
            return pacer.taken(step)
        return pacer.taken(step, cost, -neg_step)

    def _exchange(self, payload: bytes) -> None:
        """The writer thread, on every rank of a job that spans nodes: send this shard to the peer (an
        empty message when there is none to send: the peer waits for one), keep the sources' copies."""
        reqs = []
        if self.peer is not None:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)
            reqs.append(dist.isend(torch.tensor([data.numel()], dtype=torch.int64), self.peer, group=self.group))
            if data.numel():
                reqs.append(dist.isend(data, self.peer, group=self.group))
        for q in self.sources:
            payload_q = _recv(q, self.group, self.store.own)
            if payload_q:
                self.store.unpack(payload_q, self.store.held(q))
        for req in reqs:
            req.wait()

    # ------------------------------------------------------------------ the writer's outcome
    def poll(self, wait: bool = False) -> None:
        job = self._job
        if job is None or (not wait and job.thread.is_alive()):
            return
        self._job = None
        job.thread.join()
        self.cp.pacer.writer_done()
        if job.failed is not None:  # (the blocking part failed already: take())
            self._failed(job.step, job.tag, job.failed)
            return
        if job.off:
            return
        if job.error is not None:
            self._failed(job.step, job.tag, job.error)
            return
        self.failures = 0
        self.cp.emit(job.step, Record.SNAPSHOT_SAVED, {
            "tag": job.tag, "step": job.step, "dir": str(self.store.own), "bytes": job.bytes,
            "node_memory_bytes": job.node_bytes, "blocking_s": round(job.blocking, 4),
            "write_s": round(job.seconds, 3), "write_cpu_s": round(job.cpu, 4), "interval": job.interval,
            "peer": self.peer})

    def _failed(self, step: int, tag: str, error: BaseException) -> None:
        """A snapshot that could not be written (node memory full, ...): recorded, and after MAX_FAILURES in a
        row the tier stops writing on this rank -- never the job taken down, never the memory the data
        loaders and NCCL need filled again and again."""
        self.failures += 1
        self.cp.emit(step, Record.CHECKPOINT_FAILED, {"tag": tag, "dir": str(self.store.own), "tier": "memory",
                                                      "failures_in_a_row": self.failures,
                                                      "error": f"{type(error).__name__}: {error}"})
        if self.failures >= MAX_FAILURES and self.off is None:
            self.off = f"{self.failures} snapshots in a row failed to write (the last: {type(error).__name__}: {error})"
            self.cp.emit(step, Record.SNAPSHOTS_OFF, {
                "dir": str(self.store.own), "why": self.off,
                "advice": "the in-memory tier stopped writing on this rank (disk checkpoints go on); free node "
                          "memory (df /dev/shm) and restart to turn it on again"})

    def wait(self) -> None:
        self.poll(wait=True)

    # ------------------------------------------------------------------ choosing and loading (every rank together)
    def choose(self, lo: int = 0, hi: float = float("inf"), only: set[str] | None = None) -> tuple[str, int] | None:
        """The newest snapshot with ``lo <= step < hi`` (and among ``only``) that every rank can load."""
        self.wait()
        fits = self.source.fits() if hasattr(self.source, "fits") else None  # (the layout a shard must have)
        table = gather_objects(self.store.survey(world=dist.get_world_size() if dist.is_initialized() else 1,
                                                 fits=fits))
        for r, row in enumerate(table):  # (a shard or peer copy that does not verify is named, never loaded)
            for bad in row.get("refused", []):
                self.cp.emit(self.source.step(), Record.CHECKPOINT_INVALID, {**bad, "tier": "memory", "rank": r})
        found = common_choice(table, self.store.place, lo, hi, only)
        if found is None:
            return None
        tag, step, fetch = found
        self._fetch[tag] = fetch
        return tag, step

    def fetch(self, tag: str) -> list[int]:
        """Before loading ``tag``: the ranks whose node lost their shard get the copy their peer keeps.
        Returns those ranks."""
        moved = self._fetch.pop(tag, [])
        for r, holder in moved:
            if _rank() == holder:
                data = torch.frombuffer(bytearray(self.store.pack(tag, self.store.held(r))), dtype=torch.uint8)
                dist.send(torch.tensor([data.numel()], dtype=torch.int64), r, group=self.group)
                dist.send(data, r, group=self.group)
            elif _rank() == r:
                self.store.unpack(_recv(holder, self.group, self.store.own), self.store.own)
        return [r for r, _ in moved]

    def close(self) -> None:
        """The end of the run: the writer finishes, then this rank's node memory is freed."""
        self.wait()
        self.store.clear()


class _Job:
    """One snapshot's background work on one rank: write, hash, commit, exchange."""

    def __init__(self, owner: MemoryTier, tag, step, staged, staging_root, nonce, writes, json_writes,
                 manifest, blocking, interval, off: bool = False, failed: BaseException | None = None,
                 dies: bool = False):
        self.owner, self.tag, self.step, self.blocking, self.interval = owner, tag, step, blocking, interval
        self.off = off  # nothing to write (the tier is off on this rank, or `failed`): only the peer exchange
        self.failed = failed  # the blocking part's error
        self.dies = dies  # (the kill_rank fault during snapshot: the process dies after the first file)
        self.staged, self.staging_root, self.nonce = staged, staging_root, nonce
        self.writes, self.json_writes, self.manifest = writes, json_writes, manifest
        self.error: BaseException | None = None
        self.bytes = self.node_bytes = 0
        self.seconds = self.cpu = 0.0  # wall and this thread's CPU time
        self.thread = threading.Thread(target=self._run, name=f"trainguard-snapshot-{_rank()}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        t0, cpu0 = time.perf_counter(), time.thread_time()
        store = self.owner.store
        payload = b""
        try:
            if self.off:
                raise _Off
            table = {}
            for state, path in self.writes:
                path.parent.mkdir(parents=True, exist_ok=True)
                table[str(path.relative_to(self.staged))] = save_buffered(state, path)
                if self.dies:
                    os.kill(os.getpid(), signal.SIGKILL)
            for data, path in self.json_writes:
                path.parent.mkdir(parents=True, exist_ok=True)
                table[str(path.relative_to(self.staged))] = write_json_hashed(path, data)
            self.bytes = sum(v["size"] for v in table.values())
            store.commit(store.own, self.staging_root, self.nonce, dataclasses.replace(self.manifest, files=table))
            if self.owner.peer is not None:
                payload = store.pack(self.tag)
        except _Off:
            pass
        except BaseException as e:  # noqa: BLE001 - reported by poll(); the snapshot stays invisible
            self.error = e
            shutil.rmtree(self.staging_root, ignore_errors=True)  # (a full tmpfs: nothing half-written stays)
        finally:
            self.writes = self.json_writes = []  # free the host copies
        try:
            if self.owner.group is not None:
                self.owner._exchange(payload)
            self.node_bytes = store.bytes_used()
        except BaseException as e:  # noqa: BLE001
            self.error = self.error or e
        self.seconds, self.cpu = time.perf_counter() - t0, time.thread_time() - cpu0


class _Off(Exception):
    """(the writer has nothing to write: the tier is off on this rank)"""


def _recv(src: int, group, room) -> bytes:  # (announced larger than the node memory left at room: never allocated)
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src, group=group)
    if not 0 < int(size.item()) <= shutil.disk_usage(room).free:  # (0: the peer had nothing to send)
        if not int(size.item()):
            return b""
        raise RuntimeError(f"rank {src} announced a shard of {int(size.item())} bytes, more than node memory holds")
    buf = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(buf, src, group=group)
    return buf.numpy().tobytes()
