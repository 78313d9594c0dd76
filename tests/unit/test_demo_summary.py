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
    assert "pip install 'trainguard[monitor]'" in out.err and not list((tmp_path / "rep").glob("*.png"))
