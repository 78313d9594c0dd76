"""The watchdog's decision and boards, without processes: who is hung, and why."""
import time

from trainguard.observe.goodput import GoodputMeter
from trainguard.liveness.watchdog import Beat, DirBoard, Heartbeat, find_hung


def beat(rank, step, phase, progress_ago, published_ago, now):
    return Beat(rank, "h", 100 + rank, step, phase, now - progress_ago, now - published_ago)


def test_find_hung_names_the_silent_then_the_lagging_then_the_one_outside_a_collective():
    now = 1000.0
    ok = {0: beat(0, 5, "collective", 1, 0.1, now), 1: beat(1, 5, "forward", 1, 0.1, now)}
    assert find_hung(ok, 2, now, hang_timeout_s=10, interval_s=1) is None
    assert find_hung({0: ok[0]}, 2, now, 10, 1) is None  # rank 1 has not started yet: not a hang
    # rank 1's publisher went silent (SIGSTOP, dead): it is the culprit, not rank 0 waiting for it
    silent = {0: beat(0, 6, "collective", 30, 0.5, now), 1: beat(1, 5, "forward", 31, 30, now)}
    v = find_hung(silent, 2, now, 10, 1)
    assert v.culprits == [1] and "heartbeat stopped" in v.why
    assert v.describe()[0]["rank"] == 1 and v.describe()[0]["phase"] == "forward"
    # all alive, one behind
    behind = {0: beat(0, 6, "collective", 30, 0.5, now), 1: beat(1, 5, "data", 30, 0.5, now)}
    assert find_hung(behind, 2, now, 10, 1).culprits == [1]
    # all alive, same step: the one not waiting in a collective (a hang inside its own code)
    outside = {0: beat(0, 6, "collective", 30, 0.5, now), 1: beat(1, 6, "forward", 30, 0.5, now),
               2: beat(2, 6, "collective", 30, 0.5, now)}
    assert find_hung(outside, 3, now, 10, 1).culprits == [1]
    # nobody distinguishable: everyone is named
    dead = {0: beat(0, 6, "collective", 30, 0.5, now), 1: beat(1, 6, "collective", 30, 0.5, now)}
    assert find_hung(dead, 2, now, 10, 1).culprits == [0, 1]


def test_dir_board_round_trip(tmp_path):
    board = DirBoard(tmp_path / "hb", world=2)
    h = Heartbeat(rank=1)
    h.beat("backward", 7)
    board.publish(h.record())
    got = board.read()
    assert list(got) == [1] and got[1].phase == "backward" and got[1].step == 7


def test_goodput_counts_only_surviving_applied_steps():
    t = [0.0]
    m = GoodputMeter(clock=lambda: t[0])
    m.begin_step()
    for step in range(1, 11):      # 10 steps of 1 s
        t[0] += 1.0
        if step == 4:
            m.overhead(0.5)        # a checkpoint blocked half of step 4
        m.step_done(step, applied=step != 3)
    m.rollback(8)                  # steps 9 and 10 undone
    s = m.summary()
    assert s["wall_s"] == 10 and s["productive_s"] == 6.5 and s["steps_lost"] == 3
    assert s["skipped_steps"] == 1 and s["rolled_back_steps"] == 2 and s["goodput"] == 0.65
    # a restart resumes the totals; the time since the save is wall time that produced nothing
    r = GoodputMeter(clock=lambda: t[0])
    state = dict(m.state_dict(), saved_at=time.time() - 5.0)
    r.load_state_dict(state)
    assert r.summary()["productive_s"] == 6.5 and 14.9 < r.summary()["wall_s"] < 15.5


def test_heartbeats_of_the_previous_attempt_are_not_current(monkeypatch):
    """Issue 15 item 10: after a restart the board still holds the failed attempt's heartbeats; a rank
    that has not published in this attempt yet is starting, not hung."""
    now = 1000.0
    old = beat(1, 9, "forward", 60, 60, now)                         # attempt 0's, a minute old
    fresh = Beat(0, "h", 100, 6, "data", now - 20, now - 0.1, attempt=1)
    assert find_hung({0: fresh, 1: old}, 2, now, 10, 1, attempt=1) is None
    assert find_hung({0: fresh, 1: old}, 2, now, 10, 1).culprits == [1]  # (what it used to conclude)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert Heartbeat(rank=0).record().attempt == 2
    assert Beat.parse('{"rank": 0, "host": "h", "pid": 1, "step": 0, "phase": "data", "progress": 1, '
                      '"published": 1}').attempt == 0  # (a record of an older trainguard)


def test_a_failing_board_is_counted_and_warned_about(caplog):
    """Issue 15 item 10: the monitor swallowed board failures forever (hang detection silently off)."""
    from trainguard.liveness.watchdog import Monitor

    class Broken:
        def publish(self, beat):
            raise OSError("board gone")

        def read(self):
            return {}

    m = Monitor(Heartbeat(rank=0), Broken(), world=1, interval_s=0.01, hang_timeout_s=10, on_hang=lambda v: None)
    with caplog.at_level("WARNING", logger="trainguard"):
        m.start()
        deadline = time.time() + 10
        while m.errors < 3 and time.time() < deadline:
            time.sleep(0.01)
        m.stop()
        m.join(5)
    assert m.errors >= 3 and "board gone" in m.last_error
    assert any("hangs go undetected" in r.getMessage() for r in caplog.records)


def test_a_healthy_run_leaves_no_empty_stacks_file(tmp_path):
    """Issue 15 item 10: every run left an empty stacks.rank<r>.txt (opened for SIGUSR1) behind."""
    from trainguard.config import parse_block
    from trainguard.liveness.watchdog import Watchdog

    cfg = parse_block({"metrics": {"jsonl": str(tmp_path / "log.jsonl")},
                       "distributed": {"watchdog": {"board": "dir", "dir": str(tmp_path / "hb"), "interval_s": 0.05}}})

    class Guard:
        def emit(self, *a, **k):
            pass

    w = Watchdog(cfg, Guard(), Heartbeat(rank=0), rank=0, world=1, step_fn=lambda: 0, goodput=None)
    w.start()
    assert (tmp_path / "stacks.rank0.txt").exists()
    summary = w.stop()
    assert not (tmp_path / "stacks.rank0.txt").exists() and summary["board_errors"] == 0


_HUNG_FS = r"""
import sys, threading, time
import trainguard.liveness.watchdog as wd
from trainguard.config import parse_block

wd.EXIT_DEADLINE_S = 1.0
cfg = parse_block({"distributed": {"watchdog": {"board": "dir", "dir": sys.argv[2], "interval_s": 0.05,
                                                "hang_timeout_s": 0.5, "stacks_dir": sys.argv[2]}}})
forever = threading.Event()

class HungGuard:  # every write of a record blocks: the JSONL sink on a hung filesystem
    def emit(self, *a, **k):
        forever.wait()
    def coords_of(self, rank):
        return {}

w = wd.Watchdog(cfg, HungGuard(), wd.Heartbeat(rank=0), rank=0, world=2, step_fn=lambda: 0, goodput=None)
if sys.argv[1] == "hang":  # the other rank is hung; the record blocks
    now = time.time()
    beats = {0: wd.Beat(0, "h", 1, 5, "collective", now, now), 1: wd.Beat(1, "h", 2, 5, "forward", now - 60, now - 60)}
    w.on_hang(wd.find_hung(beats, 2, now, 0.5, 0.05))
else:  # the board's own read blocks
    class HungBoard:
        def publish(self, beat):
            pass
        def read(self):
            forever.wait()
    m = wd.Monitor(w.heart, HungBoard(), 2, 0.05, 0.5, w.on_hang)
    m.on_stall = w.on_stall
    m.start()
    time.sleep(60)
print("still alive")
"""


def test_a_hung_filesystem_cannot_keep_the_watchdog_from_exiting(tmp_path):
    """Issue 25 item 4: on a hang the watchdog wrote the record, the stacks and the marker before it exited;
    on a hung filesystem those block and the job is never restarted. The exit deadline is armed first.
    And a board whose own I/O blocks past the hang timeout (a hung filesystem under a 'dir' board) is a
    hang too: detection is blind, so the rank exits for a restart. (Seen failing before: both timed out.)"""
    import subprocess
    import sys

    for case in ("hang", "board"):
        t0 = time.monotonic()
        try:
            out = subprocess.run([sys.executable, "-c", _HUNG_FS, case, str(tmp_path / case)], capture_output=True,
                                 text=True, timeout=40)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{case}: the watchdog never exited") from None
        assert out.returncode == 75, (case, out.returncode, out.stderr[-2000:])
        assert "still alive" not in out.stdout and time.monotonic() - t0 < 40
        if case == "board":
            assert "hang detection is blind" in out.stderr


def test_a_hung_rank_is_signalled_only_while_its_pid_is_still_the_process_that_published_the_beat():
    """Issue 25 item 10: kill_hung_local sent SIGKILL to whatever pid the (unauthenticated) board named: a pid
    reused since, or one written there by someone else, got killed. Now the process's start time must match."""
    import signal
    import subprocess
    import sys

    from trainguard.liveness.watchdog import HangVerdict, process_start, signal_local

    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        now = time.time()
        real = Beat(1, "h", victim.pid, 5, "forward", now - 60, now - 60, started=process_start(victim.pid))
        forged = Beat(1, "h", victim.pid, 5, "forward", now - 60, now - 60, started=12345)  # a reused or forged pid
        assert signal_local(HangVerdict([1], "t", {1: forged}), "h", signal.SIGKILL) == []
        assert victim.poll() is None
        unknown = Beat(1, "h", victim.pid, 5, "forward", now - 60, now - 60)  # (an older trainguard's beat: no start)
        assert signal_local(HangVerdict([1], "t", {1: unknown}), "h", signal.SIGKILL) == []
        assert signal_local(HangVerdict([1], "t", {1: real}), "h", signal.SIGKILL) == [victim.pid]
        assert victim.wait(10) == -signal.SIGKILL
    finally:
        victim.kill()
