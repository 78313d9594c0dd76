"""The README's demo command prints the fault table and the comparison with plain DeepSpeed."""
import subprocess
import sys

import pytest

pytestmark = pytest.mark.dist


def bounded(cmd, timeout):
    """Run ``cmd``; on timeout kill its whole process tree (the demo's torchrun workers live in sessions
    of their own: a plain subprocess timeout killed the demo process only and left them running)."""
    from trainguard.demo.run import run_bounded

    rc, out, err = run_bounded(cmd, timeout, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if rc == 124:
        pytest.fail(f"{cmd[3]} did not finish in {timeout} s (its process tree was killed):\n{out[-3000:]}{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, rc, out, err)


# long (1 minute; the demo's faults are the suite's own tests): `python -m pytest -m long tests`
@pytest.mark.long
def test_demo_prints_the_table(tmp_path):
    res = bounded([sys.executable, "-m", "trainguard.cli", "demo", "--steps", "201", "--out", str(tmp_path)], 420)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    rows = [line.split() for line in lines if line.strip() and line.split()[0].isdigit()]
    assert [r[:6] for r in rows] == [
        ["20", "1", "nan_loss", "nonfinite", "(loss)", "skip_step"],
        ["60", "0", "inf_grad", "nonfinite", "(gradients)", "skip_step"],
        ["100", "1", "nan_batch", "nonfinite", "(loss)", "skip_step"],   # 3rd in 100 steps: no ckpt before 20
        ["120", "0", "bad_label", "samples_rejected", "drop_sample", "sample"],
        # the last healthy batch replays healthy: the data was bad, skipped without a rollback
        ["150", "0", "spike_batch", "instant_burst", "skip_step", rows[4][5]],
        ["180", "1", "inf_activation", "nonfinite", "(loss)", "skip_step"],
        ["200", "1", "attention_collapse", "entropy_collapse", "alert", "blocks.1.attn.softmax"],
    ]
    assert rows[2][6] == "tok"                 # nan_batch entered through the embedding output
    assert rows[5][6] == "blocks.2.mlp.2"      # the module inf_activation hit
    assert rows[6][6:8] == ["head", "3"]
    table = {line[:26].strip(): line[26:].split() for line in lines if line[:26].strip() in
             ("completed", "weights finite", "skipped steps (per rank)", "held-out loss (final)")}
    assert table["completed"] == ["True", "True"]
    assert table["weights finite"] == ["True", "True"]
    assert table["skipped steps (per rank)"] == ["[5]", "[4]"]  # trainguard also skips the spike at 150
    assert float(table["held-out loss (final)"][0]) < 3.0  # it learned: ln(128) = 4.85 at the start

    # the collapse was on rank 1: the metric line carries it (it used to show rank 0's probe only)
    log = tmp_path / "trainguard" / "trainguard.jsonl"
    import json

    (line,) = [m for m in map(json.loads, log.read_text().splitlines()) if m["type"] == "metric" and m["step"] == 200]
    assert line["attention_entropy_ratio_by_rank"]["1"]["blocks.1.attn.softmax"][3] < 0.05
    assert line["attention_entropy_ratio_by_rank"]["0"]["blocks.1.attn.softmax"][3] > 0.05
    assert line["attention_entropy_ratio"]["blocks.1.attn.softmax"][3] < 0.05
    assert len(line["clocks"]) == 2 and all(abs(t - line["time"]) < 60 for t in line["clocks"])

    # then the natural failure (nothing injected): the schedule raised 15x at 150 is acted on, the run ends better
    natural = res.stdout[res.stdout.index("A natural failure, nothing injected"):]
    did = next(x for x in natural.splitlines() if x.startswith("what trainguard did:"))
    assert "slow_rise -> rolled back" in did and "LR x0.0667" in did  # (back to the LR before the jump: x1/15)
    (held,) = [x.split()[3:] for x in natural.splitlines() if x.startswith("held-out loss (final)")]
    assert float(held[0]) < 0.8 * float(held[1])

    # trainguard report on the demo's log: the summary first, then the pictures
    rep = bounded([sys.executable, "-m", "trainguard.cli", "report", str(log), "--out", str(tmp_path / "rep")], 180)
    assert rep.returncode == 0, rep.stderr
    assert rep.stdout.startswith("trainguard summary: finished; last step 201")
    assert any(x.strip().startswith("entropy_collapse") and "ranks [1]" in x for x in rep.stdout.splitlines())
    assert (tmp_path / "rep" / "summary.txt").read_text().startswith("trainguard summary: finished")
    names = {"loss.png", "grad_norm.png", "loss_scale.png", "attention_entropy.png", "overview.png"}
    assert {p.name for p in (tmp_path / "rep").iterdir()} == names | {"summary.txt"}
    for name in names:
        data = (tmp_path / "rep" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_the_demo_run_again_into_the_same_folder_starts_over(tmp_path):
    """A second `trainguard demo --out DIR` into the folder of a first: its runs start from step 0 -- the same faults
    fire, the same table is printed -- where it once resumed the first run's checkpoint (step 50 of 60) and printed
    none of the faults before it (trainguard.demo.processes.fresh); a folder of yours in a run's place is refused by
    name and left as it was."""
    import json

    cmd = [sys.executable, "-m", "trainguard.cli", "demo", "--steps", "60", "--no-natural", "--out", str(tmp_path)]
    tables, first = [], []
    for _ in range(2):
        res = bounded(cmd, 300)
        assert res.returncode == 0, res.stdout + res.stderr
        tables.append([line for line in res.stdout.splitlines() if line.strip() and line.split()[0].isdigit()])
        first.append([json.loads((tmp_path / run / "result.rank0.json").read_text())["first_step"]
                      for run in ("trainguard", "plain")])
    assert tables[0] and tables[0][0].split()[:3] == ["20", "1", "nan_loss"] and tables[1] == tables[0]
    assert first[1] == first[0]  # (from the start both times, not from the first run's checkpoint)

    mine = tmp_path / "mine"
    (mine / "plain").mkdir(parents=True)
    (mine / "plain" / "notes.txt").write_text("my own")
    (mine / "trainguard").mkdir()
    (mine / "trainguard" / "torchrun.log").write_text("a log of yours")
    (mine / "trainguard" / "starts.rank0.txt").write_text("a run of ours left these two")
    res = bounded([*cmd[:-1], str(mine)], 300)  # (refused before either run: the guarded folder is left too)
    assert res.returncode != 0 and "plain exists and is not a folder a demo or drill run left" in res.stderr
    assert (mine / "plain" / "notes.txt").read_text() == "my own" and (mine / "trainguard" / "torchrun.log").is_file()
