"""Helpers for the multi-process tests: write a ds_config, run 2 ranks under torchrun (bounded),
read back every rank's result and the JSONL logs."""
import copy
import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from trainguard.demo.run import run_worker
from trainguard.metrics.jsonl import read

BASE = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "steps_per_print": 1000000,
    "zero_optimization": {"stage": 2},
    "trainguard": {"metrics": {"per_rank": True}},
}


@dataclass
class Run:
    rc: int
    results: list
    out: Path
    events: list = field(default_factory=list)
    metrics: list = field(default_factory=list)

    def rank_lines(self, rank):
        return read(self.out / f"trainguard.rank{rank}.jsonl")

    def ok(self):
        log = (self.out / "torchrun.log").read_text()[-4000:] if (self.out / "torchrun.log").exists() else ""
        assert self.rc == 0, f"torchrun exit {self.rc}:\n{log}"
        assert all(self.results), f"a rank wrote no result:\n{log}"
        return self


def make_config(tmp: Path, *, faults=(), block=None, **ds) -> Path:
    cfg = copy.deepcopy(BASE)
    cfg.update(ds)
    tg = cfg["trainguard"]
    tg.update(copy.deepcopy(block or {}))
    if faults:
        tg["allow_faults"] = True
        tg["faults"] = list(faults)
    path = tmp / "ds_config.json"
    path.write_text(json.dumps(cfg, indent=1))
    return path


# Runs outside CI's selection (-m 'not long', pyproject.toml) whose claim another test of the selection makes; each
# parametrized by a fixture (a release), hence marked here. `python -m pytest -m long tests` runs them.
LONG = {
    "test_megatron_dist.py::test_nan_at_each_coordinate_is_attributed_to_it[0.17.1-tp]":
        "megatron-core 0.17.1 runs under Megatron-LM core_v0.17.1's tests; the oldest, 0.16.1, keeps this one",
    "test_megatron_lm_dist.py::test_nonfinite_on_one_rank_is_named_and_skipped_pp[core_v0.17.1]":
        "core_v0.17.1's NaN handover, skip and rollback: its TP=2 ladder test; the PP=2 path is trainguard's",
    "test_megatron_lm_dist.py::test_a_killed_rank_whose_node_memory_is_gone_comes_back_from_its_peers_copy[core_v0.19.0]":
        "the peer copy is the core tier's (test_elastic_dist.py's peer-copy restart, authenticated, runs it); the "
        "megatron shard's load from node memory is the node-memory restart's, which stays",
    "test_megatron_lm_dist.py::test_sigkill_and_restart_resume_once_from_the_newest_snapshot[core_v0.19.0]":
        "the node-memory restart of core_v0.19.0 SIGKILLs a rank under torchrun too and resumes once, from the newest "
        "of --load, the disk snapshots and node memory; megatron-core's snapshot tests load dist_checkpointing's",
    "test_megatron_lm_dist.py::test_sigkill_and_restart_resume_once_from_the_newest_snapshot[core_v0.17.1]":
        "core_v0.19.0 runs the SIGKILL restart (choosing the newer of --load and the snapshot is trainguard's); "
        "core_v0.17.1 runs its ladder test",
}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(item.nodeid.endswith(k) for k in LONG):
            item.add_marker(pytest.mark.long)


@pytest.fixture
def torchrun(tmp_path):
    def go(config: Path, steps: int, *extra, out_name="run", timeout=240, launcher=()) -> Run:
        out = tmp_path / out_name
        rc, results = run_worker(config, out, steps, nproc=2, extra=list(extra), timeout=timeout, launcher=launcher)
        run = Run(rc, results, out)
        log = out / ("plain.jsonl" if "--plain" in extra else "trainguard.jsonl")
        if log.exists():
            lines = read(log)
            run.events = [x for x in lines if x["type"] == "event"]
            run.metrics = [x for x in lines if x["type"] == "metric"]
        return run
    return go
