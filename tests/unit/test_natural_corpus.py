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


def test_megatron_draws_say_the_draw_in_pretrain_gpts_names_and_carry_its_own_switch_as_a_column():
    """With Megatron-LM among the stacks: the families its arguments can say run on pretrain_gpt.py (the draw's seed,
    size and precision in its names, heads that TP=2 can split), the others stay on DeepSpeed; each Megatron-LM case
    runs a fourth, unguarded column with --check-for-spiky-loss, judged and tabled beside plain and trainguard."""
    from bench.natural.corpus import DEV, MEGATRON_FAMILIES, cases
    from bench.natural.run import PEERS, Case, judge, table

    drawn = [Case(**c) for c in cases("dev", None, ("deepspeed", "megatron"))]
    mg = [c for c in drawn if c.stack == "megatron"]
    assert len(mg) >= 6 and len(drawn) == len(DEV)
    assert {c.name.split("_x")[0].split("_", 1)[1] for c in mg} <= set(MEGATRON_FAMILIES)
    for c in mg:
        for which in ("healthy", "plain", "guarded"):
            args = c.setting(which)["args"]
            assert args[args.index("--seed") + 1] == c.name.split("_")[0][1:] and "--hidden-size" in args
            assert ("--fp16" if "_fp16_" in c.name else "--bf16") in args and "--d-model" not in args
            if "--num-attention-heads" in args:
                assert int(args[args.index("--num-attention-heads") + 1]) % 2 == 0
        assert c.setting("peer")["args"] == c.setting("plain")["args"] + PEERS["megatron"]
    run = {"died": None, "eval": 1.0, "losses": [1.0] * 30, "steps": 30, "seconds": 1.0, "events": [], "lost": 0,
           "aborted": None}
    rows = [judge(mg[0], {"healthy": run, "plain": {**run, "eval": 2.0}, "guarded": {**run, "eval": 1.05},
                          "peer": {**run, "eval": 1.9, "peer_fired": 3}})]
    assert rows[0]["peer"] == "1.900 (+90%)" and rows[0]["peer_fired"] == 3 and abs(rows[0]["peer_rel"] - 0.9) < 1e-9
    assert "--check-for-spiky-loss" in table(rows) and "+90%" in table(rows).splitlines()[-1]
