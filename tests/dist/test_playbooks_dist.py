"""docs/playbooks.md on a real run (issue 17): every command the playbooks name runs as written, on a
run whose dataset_version changed across a restart and whose second half rolled back past a NaN and
quarantined the culprit's samples; ``trainguard ckpt diff`` names what changed and ``trainguard
report`` opens with the summary."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist.conftest import make_config

pytestmark = pytest.mark.dist

PLAYBOOKS = Path(__file__).resolve().parents[2] / "docs" / "playbooks.md"


def cli(*args):
    return subprocess.run([sys.executable, "-m", "trainguard.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=120)


def playbook_commands() -> list[str]:
    text = PLAYBOOKS.read_text()
    found = re.findall(r"`(trainguard [^`]+)`", text) + re.findall(r"^    (trainguard .+)$", text, re.M)
    return sorted(set(found))


@pytest.mark.long  # (~30 s: the playbook's commands on a changed dataset; CI's time)
def test_the_playbook_commands_on_a_run_whose_data_changed(tmp_path, torchrun):
    d = tmp_path / "ck"

    def block(version):
        return {"checkpoint": {"dir": str(d), "every_steps": 4, "stable_after": 1, "dataset_id": "corpus",
                               "dataset_version": version},
                "recovery": {"skip_batches": 2, "ladders": {"nonfinite": ["rollback"]}, "replay_check": False}}

    (tmp_path / "v1").mkdir()
    (tmp_path / "v2").mkdir()
    torchrun(make_config(tmp_path / "v1", block=block("v1"), bf16={"enabled": True}), 8, out_name="first").ok()
    cfg2 = make_config(tmp_path / "v2", block=block("v2"), bf16={"enabled": True},
                       faults=[{"type": "nan_loss", "step": 10, "rank": 1}])
    run = torchrun(cfg2, 16, out_name="second").ok()   # resumes at 8 with the new data version
    (rb,) = [e for e in run.events if e["event"] == "rollback"]
    assert rb["detail"]["to_tag"] == "step00000008"
    culprit_samples = sorted(rb["detail"]["quarantined"]["1"])
    assert culprit_samples

    # ckpt diff across the restart: the data version (and so the block's hash) changed; the rollback and
    # the quarantined samples in between are named
    diff = cli("ckpt", "diff", d / "step00000008", d / "step00000016", "--json")
    assert diff.returncode == 0, diff.stderr
    got = json.loads(diff.stdout)
    assert got["lineage_changed"]["dataset_version"] == {"a": "v1", "b": "v2"}
    assert "config_hash" in got["lineage_changed"] and "dataset_id" not in got["lineage_changed"]
    assert got["steps_between"] == 8 and not got["layout_changed"]
    assert [(r["step"], r["to_tag"]) for r in got["rollbacks_between"]] == [(10, "step00000008")]
    assert got["quarantine_added"] == culprit_samples
    text = cli("ckpt", "diff", d / "step00000008", d / "step00000016").stdout
    assert "dataset_version: 'v1' -> 'v2'" in text and f"quarantined samples added: {len(culprit_samples)}" in text

    # the report opens with the answer
    rep = cli("report", run.out / "trainguard.jsonl", "--out", tmp_path / "rep")
    assert rep.returncode == 0, rep.stderr
    head = rep.stdout.splitlines()
    assert head[0].startswith("trainguard summary: finished; last step 16; goodput")
    (nan_line,) = [x for x in head if x.strip().startswith("nonfinite")]
    assert "ranks [1]" in nan_line and "action rollback" in nan_line and str(culprit_samples[0]) in nan_line
    assert any(x.strip().startswith("rollback") and "10->8" in x for x in head)
    assert (tmp_path / "rep" / "summary.txt").read_text().startswith("trainguard summary")

    # every command docs/playbooks.md names, as written there, on this run
    tags = sorted(p.name for p in d.iterdir() if p.name.startswith("step"))
    places = {"DIR/TAG_A": d / "step00000008", "DIR/TAG_B": d / "step00000016", "LOG": run.out / "trainguard.jsonl",
              "CONFIG": cfg2, "DIR": d, "TAG": tags[-1], "OUT": tmp_path / "rep2"}
    commands = playbook_commands()
    assert {c.split()[1] for c in commands} >= {"report", "ckpt", "validate"}
    for command in commands:
        words = [str(places.get(w, w)) for w in command.split()[1:]]
        done = cli(*words)
        assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-2000:])
