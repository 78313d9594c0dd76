"""A closed-form scheduler applies trainguard's LR multiplier itself (trainguard.recovery.lrapply): the LR it sets and reports
is the one the update uses; its state_dict stays the framework's (saved, loaded, pickled as before); scaling it twice
(an engine rebuilt around it) is scaling it once; a loop that cannot rewind goes on with its counter and schedule."""
import io
import types

import pytest
import torch

from trainguard.recovery.lrapply import closed_form, goes_on, schedule_scaled


def _opt():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)


def test_a_lambda_schedule_reports_and_sets_the_scaled_lr_and_saves_as_before():
    opt = _opt()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.1 * (s + 1))
    assert closed_form(sched) and not closed_form(torch.optim.lr_scheduler.StepLR(_opt(), 1)) and not closed_form(None)
    mult = [1.0]
    refresh = schedule_scaled(sched, lambda: mult[0])
    assert type(sched).__name__ == "LambdaLR" and isinstance(sched, torch.optim.lr_scheduler.LambdaLR)
    opt.step()
    sched.step()
    assert sched.get_last_lr() == [pytest.approx(0.2)] and opt.param_groups[0]["lr"] == pytest.approx(0.2)
    mult[0] = 0.5
    refresh()  # (a lowering takes effect at once, the step count unmoved)
    assert sched.last_epoch == 1 and sched.get_last_lr() == [pytest.approx(0.1)]
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.15)  # (0.3 x 0.5: never compounded)
    mult[0] = 1.0
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.4)  # (the cooldown over: the schedule's LR)
    state = sched.state_dict()
    assert "get_lr" not in state and "_trainguard_refresh" not in state
    torch.save(state, io.BytesIO())  # (what HF's Trainer saves: picklable as before)
    assert schedule_scaled(sched, lambda: 0.25) is refresh  # (scaled once: the class is not swapped again ...)
    refresh()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)  # (... and the newer session's multiplier is the one read)


def test_deepspeeds_warmup_schedule_is_scaled_too():
    from deepspeed.runtime.lr_schedules import WarmupLR

    opt = _opt()
    sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=4, warmup_type="linear")
    schedule_scaled(sched, lambda: 0.5)
    for _ in range(5):
        sched.step()
    assert sched.get_last_lr() == [pytest.approx(0.5)] and sched.state_dict() == {"last_batch_iteration": 4}  # (from -1)


def test_a_loop_that_cannot_rewind_goes_on_with_its_counter_and_schedule():
    opt = _opt()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    engine = types.SimpleNamespace(global_steps=4)
    for _ in range(4):
        sched.step()
    said = goes_on(engine, "global_steps", sched, 9)
    assert engine.global_steps == 9 and sched.last_epoch == 9 and opt.param_groups[0]["lr"] == pytest.approx(0.1)
    assert said["weights_from_step"] == 4 and said["not_replayed_iterations"] == [5, 9]
    assert goes_on(engine, "global_steps", sched, 9) == {}  # (nothing to go on to)
