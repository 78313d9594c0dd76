"""Every figure the docs take from a kept run is the run's (issue 55): a ``bench/results/*.json`` named in README.md or
docs/ exists, says its date and commit, its commit is one of this history's, a commit named beside the citation is
the JSON's, and the figures below -- parsed from the text -- equal the file's."""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
KEPT = re.compile(r"bench/results/([\w.-]+\.json)")

# (doc, a regex whose groups are figures, the JSON, its keys in the groups' order)
FIGURES = [
    ("docs/detection.md", r"adds\s+\*\*([\d,]+) ATen ops\*\* a healthy\s+step at 20 parameter tensors and \*\*([\d,]+) at 400",
     "overhead-proxies-2026-12-07-d.json", ("ops_small", "ops_large")),
    ("docs/detection.md", r"\*\*(\d+) Python calls a parameter\*\*", "overhead-proxies-2026-12-07-d.json",
     ("py_calls_per_param",)),
    ("docs/detection.md", r"\*\*(\d+) host synchronisations on the\s+critical path\*\*", "overhead-proxies-2026-12-07-d.json",
     ("added_syncs",)),
    ("docs/detection.md", r"\*\*([\d.]+) ms\*\* of the guard's own\s+host time", "overhead-proxies-2026-12-07-d.json",
     ("decide_ms",)),
    ("README.md", r"([\d,]+) ATen ops a\s+healthy step at 20 parameter tensors, ([\d,]+) at 400",
     "overhead-proxies-2026-12-07-d.json", ("ops_small", "ops_large")),
    ("README.md", r"([\d.]+) ms of its own host\s+time before the update's launch", "overhead-proxies-2026-12-07-d.json",
     ("decide_ms",)),
    ("docs/recovery.md", r"(\d+) draws,\s+\d+ forced actions", "recovery-fuzz-2026-12-07.json", ("draws",)),
    ("README.md", r"\(([\d.]+)x a step's median on 2 CPU ranks,\s+([\d.]+)x its mean", "overhead-cpu-2026-12-07-c.json",
     ("ratio", "ratio_mean")),
    ("docs/detection.md", r"\*\*([\d.]+)\*\* median \(([\d.]+)\s+ms\s+plain, ([\d.]+)\s+ms\s+guarded\), \*\*([\d.]+)\*\*\s+mean",
     "overhead-cpu-2026-12-07-c.json", ("ratio", "step_ms_plain_median", "step_ms_guarded_median", "ratio_mean")),
    ("docs/capabilities.md", r"of the clean loss \((-?[\d.]+)%, 1,000 steps", "drill-2026-12-07.json", ("loss_vs_clean",)),
    ("docs/capabilities.md", r"goodput over the in-process faults ([\d.]+), printed", "drill-2026-12-07.json",
     ("rows.2.goodput_in_process",)),
    ("docs/capabilities.md", r"the insurance \+([\d.]+)% in that run", "drill-2026-12-07.json", ("rows.1.insurance_cost",)),
    ("docs/detection.md", r"\*\*([\d.]+) ms\*\* \(one forward-only replay", "overhead-sdc-2026-12-07.json",
     ("sdc_ms_per_check",)),
    ("docs/detection.md", r"\*\*([\d.]+)% of step time at one check every 100 steps\*\*", "overhead-sdc-2026-12-07.json",
     ("sdc_share",)),
    ("docs/detection.md", r"\*\*(\d+) actions in all 5\s+runs\*\*", "natural-healthy-2026-12-07-b.json", ("actions",)),
    ("docs/detection.md", r"\*\*([\d.]+) in Megatron-LM's\*\*", "natural-healthy-2026-12-07-b.json",
     ("rows.4.alert_incidents_per_1k",)),
    ("docs/detection.md", r"every failing case acted on \*\*(\d+/\d+)\*\*; guarded within 10% of healthy or >= 90% of the gap\s+"
     r"closed \*\*(\d+/\d+)\*\*", "natural-corpus-held-out-2026-12-07-b.json", ("goals.0.figure", "goals.1.figure")),
    ("docs/detection.md", r"and\s+ended \*\*\+([\d.]+)%\*\*\)", "natural-corpus-held-out-2026-12-07-b.json",
     ("rows.15.guarded_rel",)),
    ("docs/detection.md", r"still descending slower, untouched \(\+([\d.]+)%, \+([\d.]+)%\)", "natural-corpus-held-out-2026-12-07-b.json",
     ("rows.5.guarded_rel", "rows.6.guarded_rel")),
    ("docs/detection.md", r"overhead-cpu-2026-12-07-b.json,\s+commit 2a7df56, clean\): \*\*([\d.]+)\*\* median, \*\*([\d.]+)\*\*",
     "overhead-cpu-2026-12-07-b.json", ("ratio", "ratio_mean")),
    ("docs/detection.md", r"acted on at 56 and ended at \*\*([\d.]+)\*\*\s+\(\*\*([\d.]+)%\*\* of the gap closed\)",
     "natural-corpus-held-out-megatron-2026-12-07.json", ("rows.0.guarded_eval", "rows.0.gap_closed")),
    ("docs/detection.md", r"Goals on these three: acted on \*\*(\d+/\d+)\*\* failing, near healthy \*\*(\d+/\d+)\*\*",
     "natural-corpus-held-out-megatron-2026-12-07.json", ("goals.0.figure", "goals.1.figure")),
    ("docs/detection.md", r"one of the two ended \*\*\+([\d.]+)%\*\* against healthy", "natural-corpus-held-out-megatron-fp16-2026-12-07.json",
     ("rows.1.guarded_rel",)),
    ("docs/detection.md", r"Goals: near healthy \*\*(\d+/\d+)\*\* by the two-sided rule", "natural-corpus-held-out-megatron-fp16-2026-12-07.json",
     ("goals.1.figure",)),
    ("docs/detection.md", r"every failing case acted on \*\*(\d+/\d+)\*\*, none ended by trainguard", "natural-corpus-held-out-17-24-2026-12-07.json",
     ("goals.0.figure",)),
    ("docs/detection.md", r"run, acted on \*\*(\d+/\d+)\*\*, near healthy \*\*(\d+/\d+)\*\* -- every other", "natural-corpus-held-out-17-24-2026-12-07-b.json",
     ("goals.0.figure", "goals.1.figure")),
    ("docs/detection.md", r"it ended \*\*\+([\d.]+)%\*\*: its weights went non-finite", "natural-corpus-held-out-17-24-2026-12-07-b.json",
     ("rows.3.guarded_rel",)),
    ("docs/detection.md", r"f96a835, clean; ~27 minutes here\): acted on \*\*(\d+/\d+)\*\* failing, near healthy \*\*(\d+/\d+)\*\*",
     "natural-corpus-held-out-25-32-2026-12-08.json", ("goals.0.figure", "goals.1.figure")),
    ("docs/detection.md", r"the first verdict came at 276 of 300: \*\*\+(\d+)%\*\*", "natural-corpus-held-out-25-32-2026-12-08.json",
     ("rows.6.guarded_rel",)),
    ("docs/detection.md", r"in place at its LR: \*\*\+(\d+)%\*\*; a 20x peak", "natural-corpus-held-out-25-32-2026-12-08.json",
     ("rows.7.guarded_rel",)),
    ("docs/detection.md", r"inside the trend's band: \*\*\+(\d+)%\*\*, no\s+action", "natural-corpus-held-out-25-32-2026-12-08.json",
     ("rows.3.guarded_rel",)),
    ("docs/detection.md", r"replayed\): acted on \*\*(\d+/\d+)\*\*, near healthy \*\*(\d+/\d+)\*\* -- s5031 \*\*\+([\d.]+)%\*\*",
     "natural-corpus-held-out-25-32-2026-12-08-b.json", ("goals.0.figure", "goals.1.figure", "rows.7.guarded_rel")),
    ("docs/detection.md", r"s5032 \*\*\+([\d.]+)%\*\*, and s5026", "natural-corpus-held-out-25-32-2026-12-08-b.json",
     ("rows.8.guarded_rel",)),
    ("docs/detection.md", r"restarted at 20, \+([\d.]+)%; s5020", "natural-corpus-held-out-25-32-2026-12-08-b.json",
     ("rows.2.guarded_rel",)),
    ("docs/detection.md", r"still \*\*\+(\d+)%\*\*, below", "natural-corpus-held-out-25-32-2026-12-08-b.json",
     ("rows.0.guarded_rel",)),
    ("docs/detection.md", r"acted on \*\*(\d+/\d+)\*\* failing, near healthy \*\*(\d+/\d+)\*\*, no healthy run acted on, none ended by\s+trainguard\. The miss is",
     "natural-corpus-held-out-33-40-2026-12-08.json", ("goals.0.figure", "goals.1.figure")),
    ("docs/detection.md", r"\(s5035\), \*\*\+(\d+)%\*\*, no action", "natural-corpus-held-out-33-40-2026-12-08.json",
     ("rows.2.guarded_rel",)),
    ("docs/recovery.md", r"\(the one-step warmup: \*\*\+([\d.]+)%\*\*", "natural-corpus-held-out-25-32-2026-12-08-b.json",
     ("rows.8.guarded_rel",)),
    ("docs/recovery.md", r"276 of 300 \(\*\*\+(\d+)%\*\* against healthy", "natural-corpus-held-out-25-32-2026-12-08.json",
     ("rows.6.guarded_rel",)),
    ("docs/recovery.md", r"restarted at 20 with its cut now: \*\*\+([\d.]+)%\*\*", "natural-corpus-held-out-25-32-2026-12-08-b.json",
     ("rows.7.guarded_rel",)),
    ("docs/detection.md", r"the switch fired \*\*(\d+)\*\* times", "natural-megatron-peers-2026-12-07-d.json",
     ("rows.0.peer_fired",)),
    ("docs/detection.md", r"with a tenth of the LR: \*\*([\d.]+)\*\*", "natural-megatron-peers-2026-12-07-d.json",
     ("rows.0.guarded_eval",)),
    ("docs/detection.md", r"it ended at \*\*([\d.]+)\*\*, \*\*better than plain\*\* by a\s+little \(\*\*(\d+)%\*\* of the gap",
     "natural-megatron-peers-2026-12-07-d.json", ("rows.1.guarded_eval", "rows.1.gap_closed")),
    ("docs/detection.md", r"steps lost, (\d+)%\s+of the gap closed", "natural-long-2026-12-07.json", ("rows.1.gap_closed",)),
    ("docs/checkpoints.md", r"raw write of the same bytes \(open/write/fsync\) \| ([\d,]+) MB/s", "checkpoint-io-2026-12-07.json",
     ("raw_write_MBps",)),
    ("docs/checkpoints.md", r"synchronous \(DeepSpeed's write, hashed while written, fsync, manifest, rename\) \| ([\d,]+) MB/s: "
     r"([\d.]+) of raw, ([\d.]+) of plain DeepSpeed", "checkpoint-io-2026-12-07.json",
     ("save_MBps", "save_over_raw", "save_over_plain_deepspeed")),
    ("docs/checkpoints.md", r"blocking time / synchronous save time \| ([\d.]+) \((\d+) ms blocking",
     "checkpoint-io-2026-12-07.json", ("async_blocking_over_sync", "async_blocking_s")),
    ("docs/checkpoints.md", r"medians \*\*([\d.]+) s\*\* plain\s+DeepSpeed, \*\*([\d.]+) s\*\* guard, \*\*([\d.]+) s\*\* guard "
     r"\+ snapshots every 10 steps, \*\*([\d.]+) s\*\* paced", "insurance-2026-12-07-rounds.json",
     ("median.clean", "median.guard", "median.insured", "median.paced")),
    ("docs/checkpoints.md", r"\*\*([\d.]+) ms\*\* a snapshot, \+[\d.]+% of the run at S = 10; \*\*([\d.]+) ms\*\*",
     "insurance-2026-12-07-rounds.json", ("in_step.insured.snapshot_s", "in_step.paced.snapshot_s")),
    ("docs/checkpoints.md", r"\*\*([\d.]+) ms\*\* a snapshot, \*\*\+([\d.]+)%\*\*\s+of the run", "insurance-2026-12-07-c.json",
     ("in_step.insured.snapshot_s", "in_step.insured.share")),
    ("docs/liveness.md", r"a snapshot costs \*\*([\d.]+) ms\*\* of step time, \*\*\+([\d.]+)%\*\* of the run",
     "insurance-2026-12-07-rounds.json", ("in_step.insured.snapshot_s", "in_step.insured.share")),
    ("docs/liveness.md", r"and costs \*\*([\d.]+) ms\*\*,\s+\*\*\+([\d.]+)%\*\*", "insurance-2026-12-07-rounds.json",
     ("in_step.paced.snapshot_s", "in_step.paced.share")),
    ("docs/liveness.md", r"da2a991, clean; 1,000 steps, a snapshot every 25\):\s+\*\*([\d.]+) ms\*\*, \*\*\+([\d.]+)%\*\*",
     "insurance-2026-12-07-c.json", ("in_step.insured.snapshot_s", "in_step.insured.share")),
    ("docs/liveness.md", r"\(\+([\d.]+)% in the run above", "drill-2026-12-07.json", ("rows.1.insurance_cost",)),
    ("docs/detection.md", r"kept for the rest of the run -- \*\*\+([\d.]+)%\*\*", "natural-long-2026-12-07.json",
     ("rows.0.guarded_rel",)),
    ("docs/detection.md", r"left it alone until \*\*(\d+)\*\*[\s\S]{0,120}?at 1874 -- \*\*\+([\d.]+)%\*\*, (\d+) steps lost",
     "natural-long-2026-12-07.json", ("rows.1.first_action", "rows.1.guarded_rel", "rows.1.steps_lost")),
    ("docs/capabilities.md", r"overhead-sdc-2026-12-07.json, ([\d.]+) ms per check over (\d+) checked steps, ([\d.]+)% of step "
     r"time", "overhead-sdc-2026-12-07.json", ("sdc_ms_per_check", "checked_steps", "sdc_share")),
    ("docs/detection.md", r"\| 8 \| table \| ([\d.]+) \| ([\d.]+) \| ([\d,]+) B \|", "scale-2026-12-07.json",
     ("rows.0.healthy_ms", "rows.0.anomalous_ms", "rows.0.bytes")),
    ("docs/detection.md", r"\| 1,024 \| table \(before\) \| ([\d.]+) \| ([\d.]+) \|", "scale-2026-12-07.json",
     ("rows.3.healthy_ms", "rows.3.anomalous_ms")),
    ("docs/detection.md", r"\| 65,536 \| \*\*summary\*\* \| \*\*([\d.]+)\*\* \| \*\*([\d.]+)\*\* \| \*\*(\d+) B\*\* \|",
     "scale-2026-12-07.json", ("rows.6.healthy_ms", "rows.6.anomalous_ms", "rows.6.bytes")),
    ("docs/detection.md", r"\| 65,536 \| table \(before\) \| ([\d,]+) \| ([\d,]+) \|", "scale-2026-12-07.json",
     ("rows.7.healthy_ms", "rows.7.anomalous_ms")),
    ("README.md", r"([\d.]+) s from the kill to the next step, the median of (\d+) random kills \(HF's Trainer: from its "
     r"newest checkpoint, ([\d.]+) s", "kill-anywhere-100-2026-12-07.json", ("supervised.median_s", "supervised.trials")),
    ("README.md", r"HF's Trainer: from its newest checkpoint, ([\d.]+) s", "kill-anywhere-hf-2026-12-07.json",
     ("supervised.median_s",)),
    ("docs/liveness.md", r"a spare \(`bench/results/kill-anywhere-100-2026-12-07.json`, 2026-12-07, commit 73fad06, clean\) \| (\d+) \| (\d+) \| \*\*([\d.]+) s\*\* \| "
     r"([\d.]+) s", "kill-anywhere-100-2026-12-07.json",
     ("supervised.trials", "supervised.in_process", "supervised.median_s", "supervised.p99_s")),
    ("docs/liveness.md", r"kill-anywhere-megatron-50-2026-12-07.json`, 2026-12-07, commit c1f59f5, clean; 50 draws\) \| (\d+) \| (\d+) \| \*\*([\d.]+) s\*\* \| ([\d.]+) s",
     "kill-anywhere-megatron-50-2026-12-07.json",
     ("supervised.trials", "supervised.in_process", "supervised.median_s", "supervised.p99_s")),
    ("docs/liveness.md", r"kill-anywhere-hf-2026-12-07.json`, 2026-12-07, commit 73fad06, clean; a checkpoint every 4 steps\) \| (\d+) \| (\d+) \| ([\d.]+) s \| "
     r"([\d.]+) s", "kill-anywhere-hf-2026-12-07.json",
     ("supervised.trials", "supervised.in_process", "supervised.median_s", "supervised.p99_s")),
    ("docs/liveness.md", r"goodput over the in-process faults\*\* \(([\d.]+);", "drill-2026-12-07.json",
     ("rows.2.goodput_in_process",)),
]


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def _in_history(commit: str) -> bool | None:
    done = subprocess.run(["git", "merge-base", "--is-ancestor", commit, "HEAD"], cwd=ROOT, capture_output=True)
    return None if done.returncode not in (0, 1) else done.returncode == 0


def test_every_kept_result_the_docs_name_exists_with_its_commit_in_this_history():
    wrong = []
    for doc in DOCS:
        text = doc.read_text()
        for m in KEPT.finditer(text):
            path = ROOT / "bench" / "results" / m.group(1)
            if not path.is_file():
                wrong.append(f"{doc.name}: {m.group(0)} is not kept")
                continue
            kept = json.loads(path.read_text())
            if not kept.get("date") or not kept.get("commit"):
                wrong.append(f"{m.group(0)}: no date or commit")
                continue
            if _in_history(kept["commit"]) is False:
                wrong.append(f"{m.group(0)}: commit {kept['commit']} is not in this history")
            near = text[max(0, m.start() - 300):m.end() + 300]
            for named in re.findall(r"commit ([0-9a-f]{7,40})\b", near):
                if not kept["commit"].startswith(named[:7]):
                    # (another JSON's commit may stand near too: only a mismatch with every JSON named there counts)
                    others = [json.loads((ROOT / "bench" / "results" / o).read_text()).get("commit", "")
                              for o in KEPT.findall(near) if (ROOT / "bench" / "results" / o).is_file()]
                    if not any(c and c.startswith(named[:7]) for c in others):
                        wrong.append(f"{doc.name}: commit {named} beside {m.group(0)} is not its commit")
    assert not wrong, "\n".join(sorted(set(wrong)))


@pytest.mark.parametrize("doc,pattern,kept,keys", FIGURES, ids=[f"{f[0]}:{f[3][0]}" for f in FIGURES])
def test_a_figure_in_the_text_is_the_kept_runs(doc, pattern, kept, keys):
    m = re.search(pattern, (ROOT / doc).read_text())
    assert m, f"{doc}: the figure is no longer said as {pattern!r} -- say it, or change this test with it"
    data = json.loads((ROOT / "bench" / "results" / kept).read_text())
    if "rows" in data and all("actions" in r for r in data["rows"]):  # (a table: its actions summed over the rows)
        data = {**data, "actions": sum(len(r["actions"]) for r in data["rows"])}
    for i, (group, key) in enumerate(zip(m.groups(), keys), 1):
        percent = m.string[m.end(i):m.end(i) + 1] == "%"  # (a figure said in % is the JSON's fraction)
        value = data
        for part in key.split("."):  # (a nested figure: "median.clean"; a list's item by its index: "goals.0.figure")
            value = value[int(part)] if isinstance(value, list) else value[part]
        if isinstance(value, str):  # (a figure the bench printed as it is: "10/12")
            assert group == value, (doc, key, group, value)
            continue
        in_ms = key.endswith("_s") and m.string[m.end(i):m.end(i) + 6].lstrip(" *").startswith("ms")
        value = float(value) * (1000 if in_ms else 100 if percent else 1)  # (seconds said in ms)
        decimals = len(group.split(".")[1]) if "." in group else 0  # (as printed: rounded to the digits said)
        # (the digits said are the value rounded, half up or half to even: within half a unit of the last digit)
        assert abs(_number(group) - value) <= 0.5 * 10 ** -decimals + 1e-9, (doc, key, group, value)


def test_the_demos_tables_in_its_page_are_a_kept_runs_print():
    """docs/demo.md shows what `trainguard demo` prints: each of its tables is the text a kept run of bench/demo.py
    printed (bench/results/demo-*.json, named on the page), line for line -- not a paste from an unkept run."""
    page = (ROOT / "docs" / "demo.md").read_text()
    (name,) = set(re.findall(r"bench/results/(demo-[\w.-]+\.json)", page))
    printed = "\n".join(line.rstrip() for line in
                        json.loads((ROOT / "bench" / "results" / name).read_text())["printed"].splitlines())
    blocks = [b.strip("\n") for b in re.findall(r"```\n(.*?)```", page, re.S)
              if b.startswith((" step  rank", "A natural failure"))]
    assert len(blocks) == 2
    for block in blocks:
        lines = [line for line in block.splitlines() if line.strip()]
        at = 0
        for line in lines:  # (in order; the runs' progress lines between them are left out of the page)
            found = printed.find(line, at)
            assert found >= 0, (name, line)
            at = found + len(line)


def test_the_drills_tables_in_its_page_are_a_kept_runs_print():
    """docs/liveness.md shows the fire drill's two tables: each line is what the drill prints for the kept run its page
    names (bench/results/drill-*.json: trainguard.drill.format_table over its rows, format_costs over its costs, the
    baseline's rows without a figure left out) -- not a paste from an unkept run (issue 55: it was 2026-12-04's)."""
    from trainguard.drill import format_table
    from trainguard.drill.costs import format_costs

    page = (ROOT / "docs" / "liveness.md").read_text()
    (name,) = set(re.findall(r"bench/results/(drill-[\w.-]+\.json)", page))
    kept = json.loads((ROOT / "bench" / "results" / name).read_text())
    lines = format_table(kept["rows"]).splitlines() + [
        line.rstrip() for line in format_costs(kept["costs"]).splitlines()
        if not re.search(r"plain DeepSpeed\s+-\s+-", line)]
    missing = [line for line in lines if line.rstrip() not in page]
    assert not missing, missing


# kept before bench/_results.keep wrote what measured them (issue 55): their date and commit say when; a new or re-run
# figure carries its machine and releases (and whether the tree was clean) -- never added here by hand afterwards
BEFORE_THE_FIELDS: set[str] = set()  # (every one re-kept, issue 55: the list only shrank)


def test_a_kept_result_says_what_measured_it():
    """date, commit, clean, machine, releases (bench/_results.keep) -- the files kept before keep() wrote the last
    three are listed above, and the list only shrinks."""
    lacking = []
    for path in sorted((ROOT / "bench" / "results").glob("*.json")):
        kept = json.loads(path.read_text())
        missing = [k for k in ("date", "commit", "clean", "machine", "releases") if k not in kept]
        if missing and path.name not in BEFORE_THE_FIELDS:
            lacking.append(f"{path.name}: no {', '.join(missing)}")
    assert not lacking, lacking
    stale = [n for n in BEFORE_THE_FIELDS if not (ROOT / "bench" / "results" / n).is_file() or all(
        k in json.loads((ROOT / "bench" / "results" / n).read_text()) for k in ("clean", "machine", "releases"))]
    assert not stale, f"gone or re-kept with its fields: take them off BEFORE_THE_FIELDS: {stale}"
