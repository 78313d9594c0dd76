"""A clear step's check reads the step at a glance (trainguard.ranks.glance): the summary's own figures, made from the
table's host rows before the observations and the summary are (issue 52: the host time before the update's launch)."""
from __future__ import annotations

import math
import random

import torch

from trainguard.ranks.glance import Glance
from trainguard.ranks.isolation import FIELDS, F, observations
from trainguard.ranks.reduced import Summary
from trainguard.step.agreement import Agreement

FIGURES = ("bad", "loss_bad", "faults_fired", "samples_rejected", "grad_proxy", "loss_mean", "needs_rows")
ODD = [math.nan, math.inf, -math.inf, 0.0, 1e308]


def _row(rng: random.Random) -> list[float]:
    row = [0.0] * len(FIELDS)
    row[F["micro_batches"]] = rng.choice([0, 1, 1, 2, 4, -1])
    row[F["loss_sum"]] = rng.choice([*ODD, -4.0]) if rng.random() < 0.15 else rng.uniform(0.0, 12.0)
    row[F["loss_nonfinite"]] = rng.choice([0, 0, 0, 0, 1, 2])
    row[F["grad_checked"]] = rng.choice([0, 3, 20, 20])
    row[F["grad_sq"]] = rng.choice(ODD) if rng.random() < 0.15 else rng.uniform(0.0, 50.0)
    row[F["faults_fired"]] = rng.choice([0, 0, 0, 0, 1])
    row[F["samples_rejected"]] = rng.choice([0, 0, 0, 0, 2])
    return row


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b and type(a) is type(b)


def test_a_glance_is_the_summarys_own_figures_bit_for_bit():
    """Every figure the clear check reads equals Summary.of_rows over the observations -- the same floats, NaN and
    Inf where the summary has them, None where it has none -- over 3,000 random tables of 1 to 64 ranks."""
    rng = random.Random(52)
    for trial in range(3000):
        rows = [_row(rng) for _ in range(rng.choice([1, 2, 3, 8, 64]))]
        scale, divisor = rng.choice([(1.0, 1.0), (65536.0, 4.0), (128.0, 1.0)])
        summary = Summary.of_rows(observations(rows, loss_scale=scale, grad_divisor=divisor))
        glance = Glance(rows, scale, divisor, lambda: summary)
        for name in FIGURES:
            assert _same(getattr(glance, name), getattr(summary, name)), (trial, name, rows)
        assert glance.lr is summary.lr or _same(glance.lr, summary.lr)  # (any other field: the summary's)


def test_the_table_read_makes_its_observations_only_when_asked():
    """The read at the update's launch makes the glance only; the summary, this rank's row and the rows come when DECIDE
    first asks (after a clear step's launch) and are then the same as before the glance existed."""
    agreement = Agreement(rank=0, world=1, device=torch.device("cpu"))
    row = torch.tensor(_row(random.Random(1)), dtype=torch.float64)
    row[F["micro_batches"]], row[F["loss_nonfinite"]], row[F["loss_sum"]] = 2, 0, 3.0
    view = agreement.launch(row, 1.0, 1.0)()
    assert "summary" not in vars(view) and view.glance.loss_mean == 1.5
    every = observations([row.tolist()])
    assert view.summary == Summary.of_rows(every) and view.own == every[0] and view.rows == {0: every[0]}
    assert [o.rank for o in view] == [0] and len(view) == 1 and view.full


def test_a_steps_view_is_freed_with_its_last_reference():
    """The lazy view and its glance hold no cycle: a step's table is freed when DECIDE lets go of its view, not when the
    cycle collector next runs (Megatron-LM's --manual-gc can leave it off for the whole run)."""
    import gc
    import weakref

    agreement = Agreement(rank=0, world=1, device=torch.device("cpu"))
    row = torch.tensor(_row(random.Random(3)), dtype=torch.float64)
    gc.disable()
    try:
        view = agreement.launch(row, 1.0, 1.0)()
        assert view.glance.faults_fired >= 0 and view.summary.world == 1 and view.glance.lr == view.summary.lr
        gone = weakref.ref(view)
        del view
        assert gone() is None
    finally:
        gc.enable()
