"""The supervised job's ledger (trainguard.liveness.world.Ledger) and the training process's environment
(trainguard.liveness.supervise.child_env), on a real TCPStore in this process: who gets a spare, in which generation, what a
lost spare or an exhausted pool does, and that a kill asked for one generation never reaches the next."""
from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from trainguard.liveness.supervise import child_env
from trainguard.liveness.world import Ledger


def _ledger() -> Ledger:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    return Ledger(dist.PrefixStore("test", store))


def test_the_active_ranks_keep_theirs_and_a_spare_has_none():
    env = {"RANK": "4", "WORLD_SIZE": "5", "MASTER_ADDR": "h"}
    spare = child_env(env, 4, 5, 1)
    assert spare["TRAINGUARD_ROLE"] == "spare" and spare["TRAINGUARD_SPARE"] == "0" and spare["RANK"] == "-1"
    assert spare["WORLD_SIZE"] == "4"  # (the world of the active ranks)
    active = child_env(env, 2, 5, 1)
    assert active["TRAINGUARD_ROLE"] == "active" and active["RANK"] == "2" and active["WORLD_SIZE"] == "4"


def test_spares_are_handed_out_in_turn_each_death_a_generation_until_none_is_left():
    ledger = _ledger()
    assert ledger.generation() == 0 and ledger.handed(0) is None
    assert ledger.hand_over(1, spares=2, why="pid 7, signal 9") == (0, 1)
    assert ledger.handed(0) == 1 and ledger.generation() == 1
    rank, why, _ = ledger.failure(1)
    assert rank == 1 and why == "pid 7, signal 9"
    assert ledger.hand_over(3, spares=2, why="pid 8, signal 9") == (1, 2)
    assert ledger.hand_over(0, spares=2, why="pid 9, signal 9") is None  # (none left: the whole-job restart)
    assert ledger.generation() == 2


def test_a_spare_lost_before_it_held_a_rank_is_never_handed_one():
    ledger = _ledger()
    ledger.spare_lost(0)
    assert ledger.hand_over(2, spares=2, why="x") == (1, 1)  # spare 0 passed over
    assert ledger.handed(0) is None and ledger.handed(1) == 2


def test_a_kill_asked_in_one_generation_never_reaches_the_next():
    """The watchdog asks for the hung rank's end in the generation it found it; the spare that takes the rank in the
    next generation is not killed by that request."""
    ledger = _ledger()
    ledger.request_kill(1)
    assert ledger.kill_requested(1) and not ledger.kill_requested(0)
    ledger.hand_over(1, spares=1, why="killed")
    assert not ledger.kill_requested(1)


def test_the_spares_come_from_the_launch_or_from_the_config_the_command_names(tmp_path):
    """`--spares` on the launch line wins; without it, trainguard.distributed.spares of the config file the training
    command names (a ds_config, or Megatron-LM's --trainguard-config holding the block itself); a JSON that is no
    config is passed over; a bad block is an error naming its key, not 0."""
    import json

    import pytest

    from trainguard.errors import ConfigError
    from trainguard.liveness.supervise import spares_in

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "trainguard": {"distributed": {"spares": 2}}}))
    block = tmp_path / "tg.json"
    block.write_text(json.dumps({"distributed": {"spares": 1}}))
    data = tmp_path / "data.json"
    data.write_text("[1, 2, 3]")
    assert spares_in(["train.py", "--deepspeed_config", str(ds)]) == 2
    assert spares_in(["-m", "mod", f"--deepspeed_config={ds}"]) == 2
    assert spares_in(["pretrain_gpt.py", "--data", str(data), "--trainguard-config", str(block)]) == 1
    assert spares_in(["train.py", str(data), str(ds)]) == 2  # (any .json with a trainguard block)
    assert spares_in(["train.py", "--lr", "1e-3"]) == 0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"trainguard": {"distributed": {"spares": -1}}}))
    with pytest.raises(ConfigError, match="distributed.spares"):
        spares_in(["train.py", "--deepspeed_config", str(bad)])


def test_sever_shuts_the_groups_connections_and_leaves_the_store_and_any_other_alone():
    """World.sever (gloo cannot abort a collective): the connections to an address a rank's groups listen on, and
    those accepted on this rank's group listeners, are shut down both ways -- a peer's recv sees the end at once --;
    the store's connections, a service this process used before the world formed, and trainguard's own metrics
    listener (published as excluded) keep working. Once per generation."""
    import socket

    import threading

    from trainguard.ranks.sockets import tcp_sockets
    from trainguard.liveness.world import World

    service = socket.create_server(("127.0.0.1", 0))  # (a user's service, up before the world formed)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    world = World.__new__(World)
    world.size, world.rank, world.generation, world.ledger = 1, 0, 0, Ledger(dist.PrefixStore("t", store))
    world.store_port, world.before = store.port, set(tcp_sockets())
    world.severed, world.severed_in, world.held, world._severing = 0, -1, {}, threading.Lock()
    group = socket.create_server(("127.0.0.1", 0))     # a group's listener, opened as the framework built its groups
    metrics = socket.create_server(("127.0.0.1", 0))   # trainguard's exporter: published as excluded
    peer = socket.create_connection(group.getsockname())
    accepted, _ = group.accept()
    user = socket.create_connection(service.getsockname())
    served, _ = service.accept()
    scrape = socket.create_connection(metrics.getsockname())
    scraped, _ = metrics.accept()
    world.publish(exclude=(metrics.getsockname()[1],))
    assert world.sever() == 2 and world.sever() == 2  # (the second: the first's count, nothing done again)
    peer.settimeout(5)
    assert peer.recv(1) == b""  # (its peer shut down: the wait ends at once)
    for a, b in ((user, served), (scrape, scraped)):
        a.sendall(b"x")
        assert b.recv(1) == b"x"
    store.set("still", "works")
    assert store.get("still") == b"works"
    for s in (service, group, metrics, peer, accepted, user, served, scrape, scraped):
        s.close()


def test_the_watcher_severs_as_soon_as_a_rank_is_handed_over():
    """World.watch: a thread waits on a store connection of its own for the next generation; the moment the dead
    rank's supervisor hands its rank over, this rank's group connections are shut -- a collective waiting on a dead
    rank whose sockets stay open (its forked loader workers hold them; a lost node never closes them) fails then."""
    import socket
    import threading
    import time

    from trainguard.ranks.sockets import tcp_sockets
    from trainguard.liveness.world import World

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)

    def connect(timeout=timedelta(seconds=10)):
        return dist.PrefixStore("w", dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timeout))
    world = World.__new__(World)
    world.size, world.rank, world.generation, world.ledger = 2, 0, 0, Ledger(connect(), connect)
    world.store_port, world.before = store.port, set(tcp_sockets())
    world.severed, world.severed_in, world.held, world._severing = 0, -1, {}, threading.Lock()
    group = socket.create_server(("127.0.0.1", 0))
    peer = socket.create_connection(group.getsockname())  # (the dead rank's end: held open, as its workers would)
    accepted, _ = group.accept()
    world.publish()
    world.watch()
    time.sleep(0.2)
    assert world.severed_in == -1  # (nothing happens while no rank died)
    start = time.monotonic()
    assert world.ledger.hand_over(1, spares=1, why="pid 9, signal 9") == (0, 1)
    accepted.settimeout(5)
    assert accepted.recv(1) == b"" and time.monotonic() - start < 2  # (this rank's wait ends at once)
    while world.severed_in != 0 and time.monotonic() - start < 5:  # (the count is set once every one is shut)
        time.sleep(0.01)
    assert world.severed == 2
    for s in (group, peer, accepted):
        s.close()


def test_a_spare_entering_another_call_of_the_training_function_than_the_survivors_stops_them_all():
    """trainguard.liveness.spare.same_entry: the spare runs the script from its top; a script that trains twice (a multi-phase
    one) would send it into the first call while the survivors re-enter the second -- every rank raises, naming the
    calls, instead of pairing their collectives wrongly. The same call: every rank goes on. Only the store is used."""
    import threading
    from types import SimpleNamespace

    import pytest

    from trainguard.errors import UnsupportedSetup
    from trainguard.liveness.spare import same_entry

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)

    def client():  # (each rank its own connection, as each training process has)
        return dist.PrefixStore("w", dist.TCPStore("127.0.0.1", store.port, is_master=False,
                                                   timeout=timedelta(seconds=10)))

    def enter(gen: int, calls: list[int]) -> list:
        out = [None] * len(calls)

        def rank(r):
            world = SimpleNamespace(ledger=Ledger(client()), generation=gen, rank=r, size=len(calls),
                                    timeout=timedelta(seconds=10))
            try:
                same_entry(world, calls[r])
                out[r] = "on"
            except UnsupportedSetup as e:
                out[r] = str(e)
        threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(calls))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        return out

    assert enter(1, [1, 1, 1]) == ["on"] * 3
    stopped = enter(2, [2, 1, 2])  # (rank 1's spare in the script's first training call, the survivors in the second)
    assert all("entered different calls" in s and "{0: 2, 1: 1, 2: 2}" in s for s in stopped), stopped
    alone = SimpleNamespace(ledger=Ledger(client()), generation=3, rank=0, size=2, timeout=timedelta(seconds=1))
    with pytest.raises(UnsupportedSetup, match=r"rank\(s\) \[1\] did not enter the training function"):
        same_entry(alone, 1)  # (a spare stuck in a collective of the script before it: named at the world's timeout)
    alone.generation, alone.timeout = 4, timedelta(seconds=30)
    dies = threading.Timer(0.3, lambda: Ledger(client()).store.add("gen", 5))  # (a death while it waits)
    dies.start()
    with pytest.raises(RuntimeError, match="a rank died while the world of generation 4"):
        same_entry(alone, 1)  # (at once, not at the timeout: the survivors go on to the next generation)
