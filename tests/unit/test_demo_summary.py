"""The demo's summary (trainguard.demo.run): what a reader of its table is told."""


def test_the_demos_summary_says_why_a_run_stopped():
    """The demo's natural section printed ``completed False`` with no reason for a guarded run that stopped."""
    from trainguard.demo.run import stopped_why

    abort = [{"event": "abort", "detail": {"reason": "rollback budget exhausted (5 rollbacks within 1000 steps)"}}]
    assert stopped_why([{"aborted": {"message": "x"}}, {"aborted": {"message": "x"}}], 0, abort) == \
        "trainguard stopped it: rollback budget exhausted (5 rollbacks within 1000 steps)"
    assert stopped_why([{"died": "Exception: Current loss scale already at minimum"}, None], 1, []) == \
        "Exception: Current loss scale already at minimum"
    assert stopped_why([{"aborted": None}, None], 1, []) == "1 rank(s) wrote no result (killed?); the launch exited 1"


def test_the_report_without_matplotlib_gives_its_summary_and_says_which_extra_draws(tmp_path, capsys, monkeypatch):
    """`trainguard report` crashed with ModuleNotFoundError: matplotlib after printing its summary (the [monitor]
    extra, not in a cluster's environment)."""
    import sys

    from tests.unit.test_session import run
    from trainguard.cli import main

    run(tmp_path, {"faults": [{"type": "nan_loss", "step": 4}]}, 8)
    capsys.readouterr()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # (its import raises ImportError)
    assert main(["report", str(tmp_path / "tg.jsonl"), "--out", str(tmp_path / "rep")]) == 0
    out = capsys.readouterr()
    assert "nonfinite" in out.out and (tmp_path / "rep" / "summary.txt").read_text().strip()
    assert "pip install matplotlib, or trainguard's [monitor] extra" in out.err and not list((tmp_path / "rep").glob("*.png"))


def test_the_report_tells_the_runs_story(tmp_path):
    """Issue 53: the summary left out a rank killed and replaced ("0 events"), gave a rejected sample's step but not
    its id or reason, listed sample ids for an LR problem, left out a rollback's LR and what was done about skips.
    A real run's log (an LR ramp rolled back with the LR lowered, a NaN step skipped), then the records a sanitiser
    rejection and a spare's takeover write (built by the functions that write them)."""
    import json

    from tests.unit.test_session import run
    from trainguard.observe.records import rejections
    from trainguard.observe.summary import summarize

    fw, s, seen, records, ended = run(tmp_path, {"faults": [{"type": "lr_ramp", "step": 22, "steps": 30, "factor": 1.3},
                                                            {"type": "nan_loss", "step": 6}],
                                                 "recovery": {"lr_cooldown_steps": 100}}, 45)
    assert ended is None
    lines = [json.loads(x) for x in (tmp_path / "tg.jsonl").read_text().splitlines()]
    text = summarize(lines)
    (rb,) = [x for x in text.splitlines() if x.strip().startswith("rollback ")]
    assert "LR x" in rb, text
    (skip,) = [x for x in text.splitlines() if x.strip().startswith("skip_step")]
    assert "6" in skip, text
    assert all("samples" not in x for x in text.splitlines() if x.strip().startswith("slow_rise")), text
    record, ranks, action, detail = rejections({1: {"rejected": [(17, ["token id 50300 >= vocab size 50257"])]}},
                                               lambda r: {"dp": r}, "drop")
    lines.append({"type": "event", "step": 30, "event": record.value, "ranks": ranks, "action": action,
                  "detail": detail})
    lines.append({"type": "event", "step": 33, "event": "rank_replaced", "ranks": [1], "action": None,
                  "detail": {"rank": 1, "why": "SIGKILL", "generation": 1, "resumed_at_step": 31}})
    text = summarize(lines)
    assert "17, step 30: token id 50300 >= vocab size 50257" in text, text
    (replaced,) = [x for x in text.splitlines() if x.strip().startswith("rank_replaced")]
    assert "rank 1 died (SIGKILL)" in replaced and "resumed at step 31" in replaced, text


def test_the_report_of_one_ranks_own_log_points_to_the_runs(tmp_path, capsys):
    """`metrics.per_rank` (on in configs/ds_config_hf_trainer.json) writes each rank's own lines beside the run's log;
    `trainguard report` on one of them said "no run_end record (still running, or killed)" of a finished run (a new
    user's trial, issue 53). It names the run's log instead."""
    from trainguard.cli import main

    own = tmp_path / "trainguard.rank1.jsonl"
    own.write_text('{"event": "step"}\n')
    assert main(["report", str(own), "--out", str(tmp_path / "rep")]) == 2
    err = capsys.readouterr().err
    assert "is rank 1's own log (metrics.per_rank)" in err and f"trainguard report {tmp_path / 'trainguard.jsonl'}" in err


def test_a_relaunch_of_a_finished_run_does_not_count_the_pause_between_launches(tmp_path):
    """A new user relaunched a finished HF run a minute later: it resumed (said) and its goodput read 0.018 -- the
    pause between the two launches counted as downtime. A launch that ended cleanly after the checkpoint bounds what
    counts (the steps it ran after the save: lost work); a killed one does not (its downtime is the restart's)."""
    import json

    from trainguard.observe.goodput import GoodputMeter, clean_end

    log = tmp_path / "trainguard.jsonl"
    lines = [{"time": 1000.0, "event": "run_start"}, {"time": 1040.0, "event": "run_end", "detail": {}},
             {"time": 1100.0, "event": "run_start"}]
    log.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    assert clean_end(log) == 1040.0
    saved = {"productive_s": 30.0, "wall_s": 35.0, "saved_at": 1038.0}
    finished, killed = GoodputMeter(), GoodputMeter()
    finished.load_state_dict(saved, now=1100.0, ended=clean_end(log))
    assert finished.base_wall == 35.0 + 2.0  # (the 2 s after the save; not the 60 s pause)
    killed.load_state_dict(saved, now=1100.0, ended=None)
    assert killed.base_wall == 35.0 + 62.0
    lines[1]["detail"] = {"interrupted": "RuntimeError: Connection reset by peer"}
    log.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    assert clean_end(log) is None and clean_end(tmp_path / "none.jsonl") is None
