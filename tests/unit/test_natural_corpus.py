"""bench/natural/corpus.py: generated cases, development seeds apart from held-out ones (issue 51)."""
from __future__ import annotations


def test_the_corpus_is_drawn_from_seeds_and_held_out_seeds_are_never_development_ones():
    from bench.natural.corpus import DEV, FAMILIES, HELD_OUT, cases, draw
    from bench.natural.run import Case

    assert not set(DEV) & set(HELD_OUT)
    assert draw(5003) == draw(5003) and draw(5003) != draw(5004)  # (a seed is its case: rerunnable)
    held = cases("held-out")
    assert len({c["name"] for c in held}) == len(held) == len(HELD_OUT)
    assert len({c["name"].split("_x")[0].split("_", 1)[1] for c in held}) == len(FAMILIES)  # every family drawn
    for c in held:
        case = Case(**c)
        healthy, bad = case.setting("healthy"), case.setting("plain")
        # the healthy run is the same draw -- model, precision, seed, length -- with the sane setting
        assert healthy["fp16"] == bad["fp16"] and healthy["args"][:6] == bad["args"][:6]
        assert (healthy["lr"], healthy["warmup"]) == (0.003, 100) and healthy != bad, c["name"]
        assert case.config("plain", None).get("trainguard") is None and "trainguard" in case.config("guarded", None)
