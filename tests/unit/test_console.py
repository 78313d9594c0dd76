"""The console (trainguard.metrics.console): a guarded run says on the terminal that it is guarded, what it does as it
does it, and its story at the end -- a new user found the console silent, every action only in the JSONL."""
import io

from tests.unit.test_session import run
from trainguard.config import parse_block
from trainguard.metrics.console import ConsoleSink

NAN_LADDER = {"faults": [{"type": "nan_loss", "step": k} for k in (8, 9, 10)]}


def _said(err: str) -> list[str]:
    return [x for x in err.splitlines() if x.startswith("[trainguard]")]


def test_a_guarded_run_says_it_is_guarded_what_it_does_and_how_it_ended(tmp_path, capsys):
    fw, s, _, records, ended = run(tmp_path, NAN_LADDER, 16)
    lines = _said(capsys.readouterr().err)
    assert "guarding this run" in lines[0] and "nonfinite" in lines[0] and str(tmp_path / "tg.jsonl") in lines[0]
    assert "checkpoints: " + str(tmp_path / "ck") + " every 5 steps" in lines[0]
    acted = [x for x in lines if x.startswith("[trainguard] step ")]
    assert [x.split(":")[0] for x in acted if x.split(": ", 1)[1].startswith("nonfinite")] == ["[trainguard] step 8", "[trainguard] step 9",
                                                                      "[trainguard] step 10"]
    assert any("step 8: nonfinite on rank(s) [0] -> skip_step" in x and "rank 0 (dp 0, tp 0, pp 0): samples [56," in x
               for x in acted), acted
    assert any("step 10: rollback" in x and "to_tag: step00000005" in x for x in acted)
    assert lines[-1].startswith("[trainguard] run ended at step 16, 3 step(s) skipped") and \
        "1 rollback(s)" in lines[-1] and "trainguard report " + str(tmp_path / "tg.jsonl") in lines[-1]


def test_console_false_is_silent(tmp_path):
    from trainguard.observe.eventlog import EventLog

    for console, sinks in ((True, ["ConsoleSink"]), (False, [])):
        log = EventLog(0)
        log.open(parse_block({"metrics": {"jsonl": str(tmp_path / "tg.jsonl"), "console": console}}))
        assert [type(m).__name__ for m in log.mirrors] == sinks
        log.close()
    other = EventLog(1)  # (rank 0 alone speaks)
    other.open(parse_block({"metrics": {"jsonl": str(tmp_path / "tg.jsonl")}}))
    assert other.mirrors == []


def test_lines_are_rate_limited_and_what_was_held_is_said():
    out = io.StringIO()
    sink = ConsoleSink(parse_block({"metrics": {"jsonl": "logs/tg.jsonl"}}), stream=out, per_minute=2)
    for step in range(1, 6):
        sink.event(step, "grad_surge", [1], None, {"z": 9.0})
    sink.event(6, "metric_only", [], None, {})  # (a record the console does not say)
    sink.close()
    lines = out.getvalue().splitlines()
    assert lines == ["[trainguard] step 1: grad_surge on rank(s) [1]", "[trainguard] step 2: grad_surge on rank(s) [1]",
                     "[trainguard] ... 3 more record(s) in the last minute: logs/tg.jsonl"]


def test_odd_details_never_stop_rank_0_and_actions_pass_the_rate_limit(tmp_path):
    """A custom detector's detail is yours (a per_rank list, sample ids as a set): the console says what it can, and a
    mirror that raises is logged, never raised on rank 0 alone (its peers would wait in the next collective)."""
    from trainguard.observe.eventlog import EventLog
    from trainguard.events import Record

    out = io.StringIO()
    sink = ConsoleSink(parse_block({}), stream=out, per_minute=1)
    sink.event(1, "custom_alert", ["3"], None, {"per_rank": [1, 2], "reason": {"a": 1}})
    sink.event(2, "custom_alert", [0], None, {"per_rank": {"0": {"sample_ids": {1, 2}}}})
    sink.event(3, "abort", [0], "abort", {"reason": "budget"})  # (said whatever the rate)
    sink.event(4, "run_start", [], None, {"releases": "odd", "world": 2})
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("[trainguard] step 1: custom_alert on rank(s) ['3']")
    assert lines[1] == "[trainguard] step 3: abort on rank(s) [0] -> abort (reason: budget)"
    assert "guarding this run" in lines[2]

    class Broken:
        def event(self, *a):
            raise KeyError("boom")

        def close(self):
            pass

    log = EventLog(0)
    log.open(parse_block({"metrics": {"jsonl": str(tmp_path / "tg.jsonl"), "console": False}}))
    log.mirrors.append(Broken())
    log.emit(5, Record.ROLLBACK, [0], "rollback", {"to_tag": "step00000005"})  # (no exception)
    log.close()


def test_a_resume_the_script_did_not_ask_for_is_said_with_how_to_turn_it_off(tmp_path, capsys):
    # (issue 53: an HF user's relaunch with resume_from_checkpoint=None resumed, silently)
    run(tmp_path, {}, 10)
    capsys.readouterr()
    fw, s, _, records, ended = run(tmp_path, {}, 14)
    (resumed,) = [x for x in _said(capsys.readouterr().err) if ": resume" in x]
    assert "step 10: resume" in resumed and "step00000010" in resumed, resumed
    assert 'checkpoint.resume: "latest_valid"' in resumed and 'checkpoint.resume: "none"' in resumed, resumed
    (rec,) = [r for r in records if r["event"] == "resume"]
    assert rec["detail"]["advice"].startswith("to start fresh instead")


def test_a_record_on_every_rank_of_a_large_world_is_one_short_line():
    from trainguard.metrics.console import line

    said = line(7, "resume", range(1024), None, {"tag": "step00000007"})
    assert said == "step 7: resume on 1024 ranks (tag: step00000007)"


def test_the_banner_says_whose_saves_are_the_checkpoints_and_armed_faults_and_a_set_aside_log_is_said():
    """A new user read "checkpoints: off" under HF's Trainer, whose checkpoint-N folders trainguard commits and
    verifies; an armed fault and the earlier run's log moved aside were not said at all."""
    out = io.StringIO()
    sink = ConsoleSink(parse_block({"metrics": {"jsonl": "logs/tg.jsonl"}}), stream=out)
    sink.event(0, "run_start", [], None, {"framework": "deepspeed", "world": 2})
    armed = ConsoleSink(parse_block({"allow_faults": True, "faults": [{"type": "nan_loss", "step": 8}]}), stream=out)
    armed.event(0, "run_start", [], None, {"framework": "deepspeed", "world": 2})
    sink.event(1, "fresh_start", [], None, {"earlier_log": "logs/tg.before-1.jsonl", "dir": None})
    sink.event(1, "fresh_start", [], None, {"dir": "ckpt", "earlier_log": None})  # (a checkpoint's: said elsewhere)
    lines = out.getvalue().splitlines()
    assert "checkpoints: your framework's own saves, committed and verified" in lines[0] and "FAULTS" not in lines[0]
    assert "FAULTS ARMED: 1 injected (allow_faults)" in lines[1]
    assert lines[2:] == ["[trainguard] a new run in logs/tg.jsonl: the earlier run's lines moved to "
                         "logs/tg.before-1.jsonl"]


def test_the_story_says_what_its_goodput_is_of_and_that_a_resume_counts_the_time_since_its_checkpoint():
    """A new user's relaunch ended with "goodput 0.0309" for a healthy 10-step run and no word why: the wall time
    runs from the run's start, the gap since the checkpoint it resumed from included."""
    out = io.StringIO()
    sink = ConsoleSink(parse_block({}), stream=out)
    end = {"global_steps": 40, "goodput": {"goodput": 0.0309, "steps_lost": 0, "productive_s": 1.2, "wall_s": 38.8}}
    sink.event(40, "run_end", [], None, end)
    sink.event(30, "resume", [0, 1], None, {"why": "checkpoint.resume"})
    sink.event(40, "run_end", [], None, end)
    first, _, again = out.getvalue().splitlines()
    assert "goodput 0.0309 (0 step(s) lost; 1.2 s productive of 38.8 s)" in first
    assert "1.2 s productive of 38.8 s, since the run began: the time from the checkpoint it resumed from counts" in again


def test_a_launch_stopped_by_an_error_says_so_at_its_end_and_in_the_summary():
    """A new user's Megatron-LM run, rank 1 killed: rank 0 printed "run ended at step 54" and the report said
    "finished" -- nothing said a rank died. The loop's exception is the run_end's ``interrupted``; the console and
    the summary say it, and a relaunch that finished says the stopped launch before it."""
    from trainguard.errors import interruption
    from trainguard.observe.summary import summarize

    assert interruption(None) == {} and interruption(SystemExit(0)) == {}
    why = interruption(RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer"))
    assert why == {"interrupted": "RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer"}
    out = io.StringIO()
    ConsoleSink(parse_block({}), stream=out).event(54, "run_end", [], None, {"iterations": 54, **why})
    assert "run STOPPED at step 54 by an error (RuntimeError: [../gloo" in out.getvalue(), out.getvalue()

    def end(step, **d):
        return {"type": "event", "step": step, "event": "run_end", "ranks": [], "action": None, "detail": d}
    assert summarize([end(54, **why)]).startswith("trainguard summary: STOPPED by an error at step 54 (RuntimeError")
    told = summarize([end(54, **why), end(60)])
    assert told.startswith("trainguard summary: finished (after 1 launch(es) stopped by an error, the first at step 54: "
                           "RuntimeError"), told
    assert summarize([end(60)]).startswith("trainguard summary: finished; last step 60")
    start = {"type": "event", "step": 50, "event": "run_start", "ranks": [], "action": None, "detail": {}}
    told = summarize([start, end(54, **why), {**start, "step": 51}])  # (the relaunch after it, still running)
    assert told.startswith("trainguard summary: no run_end record for the last launch (still running, or killed) "
                           "(after 1 launch(es) stopped"), told
    # (a message with braces, an empty one, several lines; trainguard's own abort and a clean exit are no interruption)
    from trainguard.errors import TrainguardAbort

    for error, said in ((ValueError("got {'rank': 1} and {0}"), "ValueError: got {'rank': 1} and {0}"),
                        (KeyboardInterrupt(), "KeyboardInterrupt (Ctrl-C, or a signal)"),
                        (RuntimeError("first line\nsecond"), "RuntimeError: first line"), (SystemExit(1), "SystemExit: 1")):
        assert interruption(error) == {"interrupted": said}
        out = io.StringIO()
        ConsoleSink(parse_block({}), stream=out).event(3, "run_end", [], None, {"iterations": 3, **interruption(error)})
        assert f"run STOPPED at step 3 by an error ({said})" in out.getvalue(), out.getvalue()
    assert interruption(TrainguardAbort("aborted")) == {} and interruption(SystemExit(None)) == {}


def test_an_attention_detector_that_found_no_module_to_sample_says_so_at_start():
    """A model whose attention is fused (HF's sdpa or flash attention) has no softmax module to sample: the banner said
    attention_entropy was on while it could never fire. It says it found none, and what would give it one."""
    out = io.StringIO()
    sink = ConsoleSink(parse_block({}), stream=out)
    sink.event(0, "run_start", [0], None, {"framework": "deepspeed", "world": 2, "probes": {"attention_modules": []}})
    sink.event(0, "run_start", [0], None, {"framework": "deepspeed", "world": 2,
                                           "probes": {"attention_modules": ["blocks.0.attn.softmax"]}})
    none, found = out.getvalue().splitlines()
    assert "attention_entropy (no attention-probability module matched" in none and "eager" in none, none
    assert "attention_entropy (" not in found and "attention_entropy" in found


def test_a_warning_under_a_frameworks_logging_names_trainguard_once():
    """Megatron-LM sets up Python's logging (``WARNING:<name>:<message>``): trainguard's warnings read
    ``WARNING:trainguard:trainguard: ...`` (issue 53). Under a configured root the name says it once; with nothing set
    up, Python's last resort prints the message alone, which keeps its "trainguard: "."""
    import io
    import logging

    import trainguard.observe.eventlog  # noqa: F401  (the filter rides the one logger every site uses)

    root, out = logging.getLogger(), io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s:%(name)s:%(message)s"))
    saved = root.handlers[:]
    root.handlers[:] = [handler]
    try:
        logging.getLogger("trainguard").warning("trainguard: %s was writable by other users", "/ck")
    finally:
        root.handlers[:] = saved
    assert out.getvalue() == "WARNING:trainguard:/ck was writable by other users\n"
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))  # (a format without the name: it keeps it)
    root.handlers[:] = [handler]
    try:
        logging.getLogger("trainguard").warning("trainguard: %s was writable by other users", "/ck2")
    finally:
        root.handlers[:] = saved
    assert out.getvalue().endswith(" trainguard: /ck2 was writable by other users\n"), out.getvalue()
    bare = logging.LogRecord("trainguard", logging.WARNING, __file__, 1, "trainguard: x", (), None)
    root.handlers[:] = []
    try:
        assert trainguard.observe.eventlog._NamedOnce().filter(bare) and bare.getMessage() == "trainguard: x"
    finally:
        root.handlers[:] = saved
