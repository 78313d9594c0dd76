"""A recovery that fails degrades, never kills (trainguard.recovery.degrade): over the fake framework of test_session.py, a
rollback forced at step 12 (checkpoints at 5 and 10) meets loads that raise -- the next older target, on where the
run was, or a clean stop with every checkpoint kept -- and the force_action fault forces each decision the policy can
take on a healthy step."""
from __future__ import annotations

import pytest
import torch

from tests.unit.test_session import TorchState, run

ROLLBACK_AT_12 = {"faults": [{"type": "force_action", "step": 12, "action": "rollback_newest"}]}


def _failing(monkeypatch, tags, touch=False):
    """TorchState.load raises for ``tags`` (a framework's load meeting a state it cannot take); ``touch``: after
    zeroing a weight first, as a load that failed part-way would."""
    real = TorchState.load

    def load(self, root, tag, *a, **k):
        if tag in tags:
            if touch:
                with torch.no_grad():
                    next(self.fw.model.parameters()).zero_()
            raise KeyError(f"optimizer.state.exp_avg not in state dict ({tag})")
        return real(self, root, tag, *a, **k)

    monkeypatch.setattr(TorchState, "load", load)


def _named(records, name):
    return [r for r in records if r["event"] == name]


def test_a_target_that_fails_to_load_is_passed_over_for_the_next_older(tmp_path, monkeypatch):
    _failing(monkeypatch, {"step00000010"})
    fw, s, _, records, ended = run(tmp_path, ROLLBACK_AT_12, 20)
    assert ended is None and fw.steps == 20
    (failed,) = _named(records, "recovery_failed")
    assert failed["step"] == 12 and failed["detail"]["to_tag"] == "step00000010" and \
        failed["detail"]["errors"][0]["ranks"] == [0] and "KeyError" in failed["detail"]["errors"][0]["error"]
    (rb,) = _named(records, "rollback")
    assert rb["detail"]["to_tag"] == "step00000005" and "failed to load" in rb["detail"]["why"]
    assert all(torch.isfinite(p).all() for p in fw.model.parameters())


def test_no_target_loading_with_the_weights_untouched_goes_on_where_it_was(tmp_path, monkeypatch):
    _failing(monkeypatch, {"step00000005", "step00000010"})
    fw, s, _, records, ended = run(tmp_path, ROLLBACK_AT_12, 20)
    assert ended is None and fw.steps == 20
    assert [r["detail"]["to_tag"] for r in _named(records, "recovery_failed")] == ["step00000010", "step00000005"]
    (un,) = _named(records, "rollback_unavailable")
    assert un["step"] == 12 and un["detail"]["failed_targets"] == ["step00000010", "step00000005"]
    assert not _named(records, "rollback") and not _named(records, "abort")


def test_a_failed_load_that_touched_the_weights_stops_cleanly_keeping_every_checkpoint(tmp_path, monkeypatch):
    _failing(monkeypatch, {"step00000005", "step00000010"}, touch=True)
    fw, s, _, records, ended = run(tmp_path, ROLLBACK_AT_12, 20)
    assert ended is not None and fw.steps == 12  # (a TrainguardAbort at the step boundary, not the KeyError)
    (abort,) = _named(records, "abort")
    assert "changed the run's state" in abort["detail"]["reason"]
    assert "step00000010: rank(s) [0]: KeyError" in abort["detail"]["reason"]
    kept = sorted(p.name for p in (tmp_path / "ck").iterdir() if p.name.startswith("step"))
    assert kept == ["step00000005", "step00000010"] and not (tmp_path / "ck" / ".abandoned").exists()


def test_a_failed_first_steps_checkpoint_takes_the_ordinary_target_with_the_ordinary_cut(tmp_path, monkeypatch):
    _failing(monkeypatch, {"step00000001"})
    block = {"faults": [{"type": "force_action", "step": 12, "action": "restart"}],
             "checkpoint": {"first_step": True}}
    fw, s, _, records, ended = run(tmp_path, block, 20)
    assert ended is None and fw.steps == 20
    (failed,) = _named(records, "recovery_failed")
    assert failed["detail"]["to_tag"] == "step00000001" and failed["detail"]["dir"].endswith(".first")
    (rb,) = _named(records, "rollback")  # (recovery.rollback_to: the newest stable one -- 10 is not, yet)
    assert rb["detail"]["to_tag"] == "step00000005" and "from_first_step" not in rb["detail"]
    assert rb["detail"]["lr_factor"] == pytest.approx(s.guard.policy.recovery.lr_factor)


@pytest.mark.parametrize("action", ["skip", "rollback", "rollback_newest", "rollback_stable", "restart", "lr_cut",
                                    "bf16_fallback"])
def test_each_forced_decision_is_carried_out_and_the_run_reaches_its_end(tmp_path, action):
    block = {"faults": [{"type": "force_action", "step": 12, "action": action}], "checkpoint": {"first_step": True}}
    fw, s, _, records, ended = run(tmp_path, block, 20, fp16=action == "bf16_fallback")
    assert ended is None and fw.steps == 20 and all(torch.isfinite(p).all() for p in fw.model.parameters())
    (injected,) = _named(records, "fault_injected")
    assert injected["step"] == 12
    rolled = _named(records, "rollback")
    if action == "skip":
        assert not rolled and s.guard.skipped_steps == 1
    else:
        (rb,) = rolled
        # (the first step's; the newest, 10; else the newest stable one, 5 -- 10 is not stable before 12 ends)
        assert rb["step"] == 12 and rb["detail"]["to_step"] == {"restart": 1, "rollback_newest": 10}.get(action, 5)
        assert (rb["detail"]["lr_factor"] is not None) == (action in ("restart", "lr_cut"))
    if action == "bf16_fallback":
        assert fw.precision == "bf16" and _named(records, "precision_fallback")


def test_targets_that_failed_are_not_tried_again(tmp_path, monkeypatch):
    """Every target fails at the rollback of 12 (the run goes on where it was); the rollback of 14 does not read the
    broken checkpoints again -- a recurring burst would re-read them at every occurrence."""
    calls = []
    real = TorchState.load

    def load(self, root, tag, *a, **k):
        calls.append(tag)
        raise KeyError("optimizer.state.exp_avg not in state dict")

    monkeypatch.setattr(TorchState, "load", load)
    block = {"faults": [{"type": "force_action", "step": 12, "action": "rollback_newest"},
                        {"type": "force_action", "step": 14, "action": "rollback_newest"}]}
    fw, s, _, records, ended = run(tmp_path, block, 16)
    assert ended is None and fw.steps == 16
    assert calls == ["step00000010", "step00000005"]
    assert [r["step"] for r in _named(records, "rollback_unavailable")] == [12, 14]


def test_a_new_checkpoint_under_a_failed_ones_name_is_loadable(tmp_path, monkeypatch):
    """Step 10 fails once at the rollback of 12 (which goes to 5); the re-run saves a new step 10, and the rollback of
    13 loads it."""
    calls = []
    real = TorchState.load

    def load(self, root, tag, *a, **k):
        calls.append(tag)
        if tag == "step00000010" and calls.count(tag) == 1:
            raise KeyError("optimizer.state.exp_avg not in state dict")
        return real(self, root, tag, *a, **k)

    monkeypatch.setattr(TorchState, "load", load)
    block = {"faults": [{"type": "force_action", "step": 12, "action": "rollback_newest"},
                        {"type": "force_action", "step": 13, "action": "rollback_newest"}]}
    fw, s, _, records, ended = run(tmp_path, block, 16)
    assert ended is None and fw.steps == 16
    assert [(r["step"], r["detail"]["to_tag"]) for r in _named(records, "rollback")] == \
        [(12, "step00000005"), (13, "step00000010")]
    assert calls == ["step00000010", "step00000005", "step00000010"]


def test_a_forced_bf16_fallback_without_an_fp16_scale_is_the_skip_the_policy_would_make():
    # (the fuzz drew a second bf16 fallback after the first had switched Megatron-LM to bf16: the policy never reaches
    # that rung without an fp16 loss scale, and the forced one aborted the run)
    from trainguard.decisions import forced
    from trainguard.events import Action

    d = forced("bf16_fallback", 15, 0.5, fp16=False)
    assert d.action is Action.SKIP_STEP and "never reaches it" in d.reason
    assert forced("bf16_fallback", 15, 0.5).action is Action.ROLLBACK
