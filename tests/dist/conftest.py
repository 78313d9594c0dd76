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
