import math

import pytest
import torch
from torch.utils.data.distributed import DistributedSampler

from trainguard.config import DataConfig, FaultSpec
from trainguard.data.position import ShardedSampler, TrackedLoader
from trainguard.faults.injector import FaultInjector
from trainguard.metrics.jsonl import JsonlSink, read


@pytest.mark.parametrize("n, world", [(100, 2), (101, 4), (7, 3)])
def test_shards_are_disjoint_and_match_distributed_sampler(n, world):
    shards = [ShardedSampler(n, r, world, shuffle=True, seed=5, drop_last=False).indices(2) for r in range(world)]
    for r, shard in enumerate(shards):
        ref = DistributedSampler(range(n), num_replicas=world, rank=r, shuffle=True, seed=5, drop_last=False)
        ref.set_epoch(2)
        assert shard == list(ref)
    dropped = [ShardedSampler(n, r, world, drop_last=True).indices(0) for r in range(world)]
    flat = [i for s in dropped for i in s]
    assert len(flat) == len(set(flat)) == (n // world) * world


def test_loader_reports_ids_and_position_and_resumes():
    data = [torch.tensor([i]) for i in range(40)]
    seen = []
    loader = TrackedLoader(data, batch_size=3, rank=1, world=2, cfg=DataConfig(seed=1),
                           listener=lambda ids, pos, rejected: seen.append((ids, pos)))
    assert len(loader) == 6  # 20 samples per rank, full batches only
    batches = list(loader)
    assert [b.view(-1).tolist() for b in batches] == [ids for ids, _ in seen]
    assert seen[-1][1].epoch == 0 and seen[-1][1].batch_in_epoch == 6
    assert loader.epoch == 1 and loader.position.consumed_samples == 6 * 3 * 2

    # stop after 2 batches of epoch 1, resume in a new loader: the same remaining batches
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    rest = [b.view(-1).tolist() for b in it]
    fresh = TrackedLoader(data, batch_size=3, rank=1, world=2, cfg=DataConfig(seed=1))
    fresh.load_state_dict(state)
    assert [b.view(-1).tolist() for b in fresh] == rest


def test_loader_refuses_too_small_a_dataset():
    with pytest.raises(ValueError, match="does not fill one micro-batch"):
        TrackedLoader([1, 2, 3], batch_size=4, rank=0, world=1)


def test_fault_injector_fires_only_at_its_step_and_rank():
    specs = [FaultSpec(type="nan_loss", step=3, rank=1), FaultSpec(type="nan_batch", step=4, rank=1),
             FaultSpec(type="inf_grad", step=5, rank=1, param="b")]
    other = FaultInjector(specs, rank=0)
    assert torch.equal(other.loss(3, torch.tensor(1.0)), torch.tensor(1.0))
    inj = FaultInjector(specs, rank=1)
    assert inj.loss(2, torch.tensor(1.0)).item() == 1.0
    assert math.isnan(inj.loss(3, torch.tensor(1.0)).item())
    batch, poison_output = inj.batch(4, {"x": torch.ones(2), "ids": torch.ones(2, dtype=torch.long)})
    assert torch.isnan(batch["x"]).all() and not poison_output
    _, poison_output = inj.batch(4, {"ids": torch.ones(2, dtype=torch.long)})
    assert poison_output  # integer-only batch: the caller poisons the first module's output
    targets = inj.grad_targets(["a", "b"])
    assert list(targets) == ["b"]
    assert torch.isinf(inj.grad(5, targets["b"], torch.zeros(3))).any()
    assert not torch.isinf(inj.grad(6, targets["b"], torch.zeros(3))).any()
    assert inj.fired_in(3) == 1 and inj.fired_in(5) == 1
    with pytest.raises(ValueError, match="not a parameter"):
        FaultInjector([FaultSpec(type="inf_grad", step=1, rank=0, param="zzz")], 0).grad_targets(["a"])


def test_one_bad_sample_and_corrupted_weights():
    inj = FaultInjector([FaultSpec(type="nan_batch", step=2, rank=0, sample=1),
                         FaultSpec(type="nan_weights", step=3, rank=0, param="1.weight")], rank=0)
    batch, poison = inj.batch(2, {"x": torch.ones(3, 2)})
    assert torch.isnan(batch["x"][1]).all() and torch.isfinite(batch["x"][[0, 2]]).all() and poison is None
    _, poison = inj.batch(2, {"ids": torch.ones(3, dtype=torch.long)})  # (another micro-batch of the step)
    assert poison.row == 1 and poison.for_row(1).row is None and poison.for_row(0) is None
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    step = {"now": 2}
    inj.install_module_faults(model, lambda: step["now"])
    model(torch.ones(1, 2))
    assert torch.isfinite(model[1].weight).all()
    step["now"] = 3
    with inj.held():  # a replay: module faults hold still
        model(torch.ones(1, 2))
    assert torch.isfinite(model[1].weight).all()
    model(torch.ones(1, 2))
    assert torch.isnan(model[1].weight).any() and torch.isfinite(model[0].weight).all()
    with pytest.raises(ValueError, match="'sample' applies only"):
        FaultSpec(type="nan_loss", step=1, sample=0)
    with pytest.raises(ValueError, match="not a parameter"):
        FaultInjector([FaultSpec(type="nan_weights", step=1, rank=0, param="zzz")], 0).install_module_faults(
            model, lambda: 1)


def test_jsonl_is_strict_json(tmp_path):
    sink = JsonlSink(tmp_path / "x.jsonl")
    sink.metric(1, loss=float("nan"), grad_norm=float("inf"), lr=torch.tensor(0.5), skipped_steps=0)
    sink.close()
    text = (tmp_path / "x.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    (line,) = read(tmp_path / "x.jsonl")
    assert line["loss"] is None and line["grad_norm"] is None and line["lr"] == 0.5 and "time" in line


def test_report_refuses_a_log_without_metrics(tmp_path):
    from trainguard.observe.report import render

    (tmp_path / "empty.jsonl").write_text('{"type": "event", "step": 0, "event": "run_start"}\n')
    with pytest.raises(ValueError, match="no metric lines"):
        render(tmp_path / "empty.jsonl", tmp_path / "out")


def test_loader_quarantines_a_dirty_batch_and_reads_the_next():
    from trainguard.config import SanitizeConfig

    data = [{"input_ids": torch.tensor([i % 7 + 1, 2]), "labels": torch.tensor([1, 99 if i == 5 else 2])}
            for i in range(24)]
    got = []
    loader = TrackedLoader(data, batch_size=2, rank=0, world=1, cfg=DataConfig(shuffle=False),
                           sanitize_cfg=SanitizeConfig(vocab_size=10, action="quarantine_batch"),
                           listener=lambda ids, pos, rejected: got.append((ids, rejected)))
    batches = list(loader)
    assert len(batches) == 11                       # 12 batches, the one holding sample 5 set aside
    assert [ids for ids, _ in got][2] == [6, 7]     # after [0, 1], [2, 3] came [6, 7]: [4, 5] was skipped
    assert got[2][1] == [(5, ["label 99 outside [0, 10) (ignore_index -100 allowed)"]),
                         (4, ["quarantined with its batch"])]
    assert loader.quarantine == [5, 4] and loader.state_dict()["quarantine"] == [5, 4]
