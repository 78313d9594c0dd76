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
