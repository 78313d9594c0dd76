"""A supervised training process's place in the job (trainguard.supervise): its rank, its generation, forming the
world again after a rank died.

The job's facts live on torchrun's store (its agent hosts it: it outlives every worker), under this restart
attempt's prefix -- the :class:`Ledger`: the current generation, the spares handed out and to which rank, the
training processes that finished. Generation ``g``'s process group is formed on the prefix ``gen<g>``, so the
world formed again never meets the addresses the last one left.

A survivor whose collective failed calls :meth:`World.reform` once nothing holds the old groups any more (the
framework's state dropped -- it is restored from a snapshot after -- and the exception handled: a traceback holds
the failed work, and with it the group's sockets). Destroying its groups closes its sockets, so a peer still
waiting on this rank fails at once (measured on gloo: ~20 ms), not at its collective's timeout; gloo cannot abort
a collective otherwise. It then waits for the next generation -- opened by the dead rank's supervisor, with a
spare in its place -- and forms the world again with the same rank.
"""
from __future__ import annotations

import gc
import os
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from trainguard.ranks.sockets import fds as _fds
from trainguard.ranks.sockets import tcp_sockets

POLL_S = 0.005
ROLE, SPARE = "TRAINGUARD_ROLE", "TRAINGUARD_SPARE"  # a training process's place, from its supervisor


class Ledger:
    """The job's facts on torchrun's store (every supervisor and training process sees the same)."""

    def __init__(self, store, connect=None):
        self.store = store
        self.connect = connect  # () -> another client of the same store (a thread's own: trainguard.liveness.world.World)

    @classmethod
    def connect(cls, env=os.environ, timeout_s: float = 300.0) -> "Ledger":
        if env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
            raise RuntimeError("a supervised job runs under torchrun, whose agent hosts the store that outlives any "
                               "worker (TORCHELASTIC_USE_AGENT_STORE is not true)")
        prefix = f"trainguard/inprocess/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"

        def connect(timeout=timedelta(seconds=timeout_s)):
            return dist.PrefixStore(prefix, dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                                                          timeout=timeout))
        return cls(connect(), connect)

    def generation(self) -> int:
        return self.store.add("gen", 0)

    def hand_over(self, rank: int, spares: int, why: str) -> tuple[int, int] | None:
        """From the dead rank's supervisor: the next spare takes ``rank`` in a new generation. Returns (the spare,
        the generation), or None with no spare left."""
        taken = self.store.add("spares_used", 1)
        while taken <= spares and self.store.check([f"spare_lost/{taken - 1}"]):  # (its process died waiting)
            taken = self.store.add("spares_used", 1)
        if taken > spares:
            self.store.set("no_spare", f"{rank}: {why}")
            return None
        generation = self.store.add("gen", 1)
        self.store.set(f"failed/{generation}", f"{rank}: {why}; at {time.time()!r}")
        self.store.set(f"spare/{taken - 1}", f"{rank}:{generation}")
        self.store.set(f"opened/{generation}", "1")  # (what every rank's watcher waits for: World.watch)
        return taken - 1, generation

    def failure(self, generation: int) -> tuple[int, str, float]:
        """(the rank that died, why, when) -- what opened ``generation``."""
        text = self.store.get(f"failed/{generation}").decode()
        rank, rest = text.split(": ", 1)
        why, at = rest.rsplit("; at ", 1)
        return int(rank), why, float(at)

    def request_kill(self, rank: int) -> None:
        """From a watchdog that found ``rank`` hung: its supervisor kills its training process (of this generation:
        never the spare that takes the rank after)."""
        self.store.set(f"kill/{rank}/{self.generation()}", "1")

    def kill_requested(self, rank: int) -> bool:
        return self.store.check([f"kill/{rank}/{self.generation()}"])

    def handed(self, spare: int) -> int | None:
        """The rank handed to a spare (None: none yet) -- from the moment it is handed, joined or not."""
        key = f"spare/{spare}"
        return int(self.store.get(key).decode().split(":")[0]) if self.store.check([key]) else None

    def spare_lost(self, spare: int) -> None:
        """A spare's process died before any rank was handed to it: never handed one."""
        self.store.set(f"spare_lost/{spare}", "1")

    def finished(self) -> int:
        return self.store.add("finished", 0)

    def wait_finished(self, active: int) -> None:
        while self.finished() < active:
            time.sleep(0.2)


class World:
    """This training process's place: ``rank`` (None for a spare not yet needed) in a world of ``size``."""

    def __init__(self, env=os.environ, backend: str = "gloo", timeout: timedelta = timedelta(minutes=30)):
        self.role = env[ROLE]
        self.size = int(env["WORLD_SIZE"])
        self.rank: int | None = int(env["RANK"]) if self.role == "active" else None
        self.spare = int(env[SPARE]) if self.role == "spare" else None
        self.backend, self.timeout = backend, timeout
        self.ledger = Ledger.connect(env)
        self.generation = 0
        self.store_port, self.before = int(env["MASTER_PORT"]), set(tcp_sockets())  # (the store's connections)
        self.left_open: list[str] = []  # its groups' connections the last world's destruction did not close
        self.severed, self.severed_in, self.held = 0, -1, {}  # (sever: how many, in which generation, which)
        self._severing = threading.Lock()  # (the main thread's and the watcher's)
        World.current = self

    current: "World | None" = None  # this process's (trainguard.liveness.replacement reads it from the watchdog)

    @staticmethod
    def supervised(env=os.environ) -> bool:
        return ROLE in env

    def publish(self, exclude: tuple[int, ...] = ()) -> None:
        """The addresses this rank's groups listen on (every listener this process opened since it joined, but
        ``exclude``'s ports -- trainguard's metrics exporter), for :meth:`sever`: when the world formed, and again
        once the framework built its groups."""
        self.listening = {(a, p) for i, (a, p, _, rp, _) in tcp_sockets().items()
                          if i not in self.before and not rp and p not in exclude}
        self.ledger.store.set(f"listeners/{self.generation}/{self.rank}",
                              ",".join(f"{a}|{p}" for a, p in sorted(self.listening)))

    def groups_connections(self) -> dict[str, tuple]:
        """This generation's group connections on this rank: to an address a rank's groups listen on, or accepted on
        one of this rank's (the store's and any other are not)."""
        keys = [f"listeners/{self.generation}/{r}" for r in range(self.size)]
        store, published = self.ledger.store, set()
        values = store.multi_get(keys) if store.check(keys) else \
            [store.get(k) for k in keys if store.check([k])]  # (one round trip when every rank published)
        for v in values:
            published |= {(a, int(p)) for a, p in (x.split("|") for x in v.decode().split(",") if x)}
        ports = {p for a, p in published if a in ("0.0.0.0", "::")}  # (a listener on every address: its port)
        mine = {p for _, p in getattr(self, "listening", ())}
        return {i: c for i, c in tcp_sockets().items() if i not in self.before and c[3] and
                c[3] != self.store_port and (c[1] in mine or (c[2], c[3]) in published or c[3] in ports)}

    def sever(self) -> int:
        """Gloo cannot abort a collective: the connections of this generation's groups (:meth:`groups_connections`)
        are shut down instead, both ways, so that every collective in flight on them fails at once -- on this rank and
        on the peers that wait on it -- and destroying the groups does not wait for one (a group's destruction drains
        its work in flight). Once per generation (again: the count of the first). Returns how many were shut."""
        with self._severing:
            return self._sever()

    def _sever(self) -> int:
        import socket
        import stat

        if self.severed_in == self.generation:
            return self.severed
        self.held = self.groups_connections()
        fds, done = _fds(), 0
        for inode in self.held:
            fd = fds.get(inode)
            if fd is None:
                continue
            try:
                dup = os.dup(fd)
            except OSError:
                continue
            try:  # (the descriptor may have been closed and reused since it was listed: the inode says)
                st = os.fstat(dup)
                if stat.S_ISSOCK(st.st_mode) and str(st.st_ino) == inode:
                    with socket.socket(fileno=dup) as sock:
                        dup = None
                        sock.shutdown(socket.SHUT_RDWR)
                        done += 1
            except OSError:
                pass
            finally:
                if dup is not None:
                    os.close(dup)
        self.severed_in, self.severed = self.generation, done
        return done

    def join(self) -> int | None:
        """Form the world: an active rank at once (generation 0); a spare once a rank is handed to it -- or None
        when the job's training processes all finished without it."""
        if self.role == "spare":
            key = f"spare/{self.spare}"
            while not self.ledger.store.check([key]):
                if self.ledger.finished() >= self.size:
                    return None
                time.sleep(POLL_S)
            rank, generation = map(int, self.ledger.store.get(key).decode().split(":"))
            self.rank, self.generation = rank, generation
        self._form()
        self.watch()
        return self.rank

    def watch(self) -> None:
        """A thread of this process waits, on a store connection of its own (no polling), for the next generation to
        open -- a rank died and its supervisor handed its rank over -- and then shuts this rank's groups' connections
        (:meth:`sever`) at once: a collective waiting on the dead rank might not see its sockets close for seconds
        (the data-loader workers it forked hold them until they notice their parent is gone: ~5 s measured on
        Megatron-LM) or ever (a node lost sends nothing)."""
        if self.ledger.connect is None:
            return

        def watching():
            try:
                store = self.ledger.connect(timedelta(days=7))
                while True:
                    following = self.generation + 1
                    store.wait([f"opened/{following}"], timedelta(days=7))
                    if self.generation < following:
                        self.sever()
                    while self.generation < following:  # (this rank forms it: then the one after is watched)
                        time.sleep(0.05)
            except Exception:  # noqa: BLE001 - the job ended (its store with it): nothing left to watch
                return

        threading.Thread(target=watching, name="trainguard-generation-watch", daemon=True).start()

    def replaced(self, wait_s: float = 2.0) -> bool:
        """Whether a new generation opened (a rank died and its supervisor handed its rank over) within ``wait_s``:
        asked before a survivor lets go of anything, so that a failure that was not a death is raised as it was."""
        deadline = time.monotonic() + wait_s
        while self.ledger.generation() <= self.generation:
            if time.monotonic() > deadline:
                return False
            time.sleep(POLL_S)
        return True

    def reform(self, wait_s: float = 60.0) -> float:
        """After a collective failed: every group destroyed (its sockets closed), the next generation awaited, the
        world formed again with this rank. Returns the seconds it took. Raises TimeoutError when no generation
        opens within ``wait_s`` (no rank died: the failure was something else, or a hung rank is still alive)."""
        start = time.monotonic()
        self.sever()  # (the adapters' replacement severed first already: once per generation)
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()  # (what still held the groups: their sockets close now)
        self.left_open = sorted(set(self.held) & set(_fds()))
        if self.left_open:
            import sys

            print(f"[trainguard rank {self.rank}] {len(self.left_open)} connections of the old world's groups are still "
                  "open after their destruction: something still holds the groups (they were shut down: no peer "
                  "waits on them)", file=sys.stderr, flush=True)
        deadline = start + wait_s
        while self.ledger.generation() <= self.generation:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rank}: a collective failed and no rank was replaced within {wait_s:.0f}"
                                   " s (no supervisor opened a new generation)")
            time.sleep(POLL_S)
        self.generation = self.ledger.generation()
        self._form()
        return time.monotonic() - start

    def _form(self) -> None:
        os.environ["TRAINGUARD_GENERATION"] = str(self.generation)  # (trainguard.ranks.attempt: faults of one attempt)
        dist.init_process_group(self.backend, store=dist.PrefixStore(f"gen{self.generation}", self.ledger.store),
                                rank=self.rank, world_size=self.size, timeout=self.timeout)
        self.publish()  # (the default group's, at once: a death before the run resumed finds them too)
