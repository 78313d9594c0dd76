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


def test_hf_draws_run_the_same_model_the_trainer_can_run():
    """With HF's Trainer among the stacks: its cases carry the draw's seed and model size to bench/natural/hf_train.py
    (which takes them), run bf16, and never the mid-run LR raise (those stay on DeepSpeed)."""
    import argparse
    from pathlib import Path

    from bench.natural.corpus import DEV, cases
    from bench.natural.run import Case

    drawn = [Case(**c) for c in cases("dev", None, ("deepspeed", "hf"))]
    hf = [c for c in drawn if c.stack == "hf"]
    assert len(hf) >= 8 and len(drawn) == len(DEV)
    for c in hf:
        bad = c.setting("plain")
        assert not bad["fp16"] and "--raise-lr" not in bad["args"] and c.name.endswith("_hf")
        args = c.args("guarded")
        assert args[args.index("--seed") + 1] == c.name.split("_")[0][1:] and "--d-model" in args
        assert c.launch("guarded")["module"] == "bench.natural.hf_train" and "trainguard" in c.config("guarded", Path("/tmp/x"))
    # every flag a case passes is one hf_train.py takes
    import bench.natural.hf_train as hf_train

    taken = set()
    real = argparse.ArgumentParser.add_argument

    def note(self, *names, **kw):
        taken.update(n for n in names if n.startswith("--"))
        return real(self, *names, **kw)

    argparse.ArgumentParser.add_argument = note
    try:
        try:
            hf_train.main(["--config", "x", "--out", "/nonexistent/never", "--help"])
        except SystemExit:
            pass
    finally:
        argparse.ArgumentParser.add_argument = real
    passed = {a for c in hf for a in c.args("guarded") if a.startswith("--")}
    assert passed <= taken, passed - taken
