"""The watchdog's decision and boards, without processes: who is hung, and why."""
import time

from trainguard.goodput import GoodputMeter
from trainguard.watchdog import Beat, DirBoard, Heartbeat, find_hung


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
