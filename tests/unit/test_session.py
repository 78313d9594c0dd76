"""GuardSession over a framework made of plain torch calls (issue 24): every ladder in one process, the loop
points called in :class:`trainguard.events.Event`'s order, and the checkpoints committed and loaded through the
core's checkpoint manager over a trainguard.protocols.State (TorchState) -- what an adapter for a new framework
would write, and all it would write."""
from __future__ import annotations

import math
import re

import torch

# (the fake framework imports what an adapter may: tests/unit/test_structure.py holds this module to it)
from trainguard.config import parse_block
from trainguard.errors import TrainguardAbort
from trainguard.events import Action, Event
from trainguard.ports import (
    AppliedGradMeter, Framework, gather_coords, host_copy, install_grad_hooks, ModuleReplays, rows_of, save_hashed, ScalerState,
    StepOutcome, verified_reads, zero_adam_moments,
)
from trainguard.step.session import GuardSession

BASE = {"checks": {"enabled": False}, "allow_faults": True,
        "detectors": {"grad_norm": {"enabled": False}, "attention_entropy": {"enabled": False},
                      "activation_range": {"enabled": False}, "straggler": {"enabled": False},
                      "loss_spike": {"min_history": 5, "window": 16}},
        "recovery": {"skip_batches": 0},
        "checkpoint": {"every_steps": 5, "stable_after": 2, "verify_steps": 0, "keep_last": 20}}


class FakeScaler:
    """An fp16 dynamic loss scaler: halves on an overflow, down to its floor."""

    def __init__(self):
        self.scale, self.min_scale = 4.0, 1.0

    def state(self):
        return ScalerState(self.scale, self.min_scale)

    def reset(self):
        self.scale = max(4.0, self.min_scale)
        return {"scale": self.scale}

    def raise_floor(self, factor):
        self.min_scale *= factor
        return {"min_scale": self.min_scale}


class TorchState:
    """trainguard.protocols.State over a torch model and optimizer: the framework's state as one file per rank,
    saved and loaded by the core's checkpoint manager (its protocol, manifest, sidecars, async saves) -- framework
    calls only, as a new adapter's would be."""

    name, format, nothing = "torch", "torch", None

    def __init__(self, fw):
        self.fw = fw

    def step(self):
        return self.fw.steps

    def layout(self):
        return {"world": 1, "dp": 1, "tp": 1, "pp": 1, "precision": self.fw.precision}

    def versions(self):
        return {}

    def health(self):
        return {"skipped_steps": self.fw.not_applied}

    def precision_bound(self):
        return False

    def _state(self):
        return {"model": self.fw.model.state_dict(), "optimizer": self.fw.opt.state_dict(), "steps": self.fw.steps}

    def write(self, staged, tag, **kw):
        return {"state.pt": save_hashed(self._state(), staged / "state.pt")}  # (hashed as written)

    def capture(self, staging_root, tag, **kw):
        return [(host_copy(self._state()), staging_root / tag / "state.pt")]

    def sidecar(self, **kw):
        return {}

    def restore_sidecar(self, side):
        return None

    def use_data(self, data, result):
        return result

    def conversion(self, man):
        return False

    def convert(self, source, out):
        return "no conversion"

    def load(self, root, tag, man, reader, purpose, converted=False, **kw):
        """The framework's part of the core's load: its files, read through the verified reader."""
        with verified_reads(reader):
            state = torch.load(root / tag / "state.pt", weights_only=True)
        self.fw.model.load_state_dict(state["model"])
        self.fw.opt.load_state_dict(state["optimizer"])
        self.fw.steps = state["steps"]
        return tag, {}

    def load_shard(self, own, tag, reader, purpose, **kw):
        return self.load(own, tag, None, reader, purpose)

    def shard_source(self):
        return None


class TorchFramework:
    """trainguard.protocols.Framework over a torch model and optimizer: framework calls only."""

    rank = 0
    data = None
    applied_grad = None

    def __init__(self, cfg, fp16=False):
        torch.manual_seed(0)
        self.cfg = cfg
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        self.steps = self.not_applied = 0
        self.precision = "fp16" if fp16 else "fp32"
        self._scaler = FakeScaler() if fp16 else None
        self.clip = None
        self.checkpointer = None
        self.faults = None  # the session's FaultInjector (fp16_overflow fires while the run is fp16)

    def completed_steps(self):
        return self.steps

    def scaler(self):
        return self._scaler

    def agree_scale(self):
        return (self._scaler.scale if self._scaler else 1.0), 1.0

    def set_clip(self, max_norm):
        self.clip = max_norm

    def apply(self, decision, base_step):
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else None
        overflow = self._scaler is not None and norm is not None and not math.isfinite(float(norm))
        if decision.action in (Action.SKIP_STEP, Action.ROLLBACK) or overflow:
            if overflow:  # (the scaler's own skip: the scale halves, down to its floor)
                self._scaler.scale = max(self._scaler.scale / 2, self._scaler.min_scale)
            self.opt.zero_grad()
            applied, result = False, None
        else:
            result, applied = base_step(), True
        self.not_applied += not applied
        self.steps += 1
        return StepOutcome(result, applied, norm if applied else None, self.clip)

    def lr_groups(self):
        return self.opt.param_groups

    def after_rollback(self, step):
        return {}

    def skipped_steps(self):
        return self.not_applied

    def reset_moments(self):
        return zero_adam_moments(self.opt)

    def applied_grad_meter(self):
        return AppliedGradMeter([self.opt])  # (the core's: what each update applied, after any clipping)

    def fallback_to_bf16(self, step):
        # as DeepSpeed's engine and megatron's distributed optimizer are: a new optimizer object over the same
        # parameters, its state carried -- the session arms what depends on the precision again (to_bf16)
        state, self.opt = self.opt.state_dict(), torch.optim.Adam(self.model.parameters(), lr=1e-2)
        self.opt.load_state_dict(state)
        self.precision, self._scaler = "bf16", None
        return {"rebuilt": "in place"}


def _recorded(guard, seen):
    """Every loop point the guard is called at, in order: one letter per Event."""
    for ev in Event:
        name = f"on_{ev.value}"
        real = getattr(guard, name)

        def wrapper(*a, _real=real, _ev=ev, **k):
            seen.append(_ev)
            return _real(*a, **k)
        setattr(guard, name, wrapper)


def run(tmp_path, block, steps, fp16=False, replays=False, facts=None, between=None):
    """A user's loop over the fake framework, through the session's loop points. Returns (framework, session,
    the Events seen, the records written, the exception that ended the run or None). ``between(session, step)``:
    called after each step, before the next begins. ``replays``: the fake records
    each micro-batch and replays it through the core's ModuleReplays, as DeepSpeed's adapter does (data or weights,
    the culprit sample narrowed, the first bad module localised)."""
    block = {**BASE, **block, "metrics": {"jsonl": str(tmp_path / "tg.jsonl")},
             "checkpoint": {**BASE["checkpoint"], **block.get("checkpoint", {}), "dir": str(tmp_path / "ck")}}
    cfg = parse_block(block)
    fw = TorchFramework(cfg, fp16=fp16)
    assert isinstance(fw, Framework)
    again = ModuleReplays(lambda: fw.model, 0) if replays else None
    session = GuardSession(fw, cfg, 0, 1, **({"localize": again.localize, "replay": again.replay,
                                              "narrow_rows": True} if replays else {}))
    if again is not None:
        again.bind(session)
    seen: list[Event] = []
    _recorded(session.guard, seen)
    fw.faults = session.faults
    if session.faults is not None:
        session.faults.precision = fw.precision
    session.hooks += install_grad_hooks(list(fw.model.named_parameters()), session.faults, lambda: fw.steps + 1,
                                       session.backward)
    session.arm(framework_clip=0.0)  # (plain torch clips nothing of its own)
    fw.checkpointer = session.start(TorchState(fw), gather_coords(dp=0, tp=0, pp=0, local_rank=0),
                                    {"framework": "torch"}, facts)
    session.running()  # (a fresh checkpoint folder: nothing to resume)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(steps)]
    ended = None
    try:
        while fw.steps < steps:
            step = fw.steps + 1
            x, y = data[step - 1]
            session.batch(list(range(8 * (step - 1), 8 * step)), None)
            (x, y), _ = session.forward(step, (x, y))
            if replays and session.replays.wants_batches:  # (references: what a replay of this micro-batch needs)
                session.replays.record(((x,), {}, None), rows_of(((x,), {})))
            with session.probing(step):
                loss = ((fw.model(x) - y) ** 2).mean()
            session.forward_done()
            session.loss(step, loss).backward()
            session.step(fw.opt.step)
            fw.opt.zero_grad()
            if between is not None:
                between(session, step)
    except TrainguardAbort as e:
        ended = e
    session.close({"steps": fw.steps})
    from trainguard.metrics.jsonl import read

    records = [x for x in read(tmp_path / "tg.jsonl") if x.get("type") == "event"]
    return fw, session, seen, records, ended


LETTER = {Event.BEGIN: "B", Event.BATCH: "b", Event.FORWARD: "f", Event.LOSS: "l", Event.BACKWARD: "g",
          Event.AGREE: "A", Event.DECIDE: "D", Event.STEP: "S", Event.END: "E", Event.CLOSE: "C"}
ORDER = re.compile(r"B(bflg+ADSE)+C")  # Event's docstring: BEGIN, per step (BATCH FORWARD LOSS BACKWARD+) AGREE
#                                        DECIDE STEP END, then CLOSE


def _events(records):
    return [(r["event"], r["step"], r["action"]) for r in records
            if r["event"] not in ("run_start", "run_end", "checkpoint_saved", "checkpoint_stable")]


def test_every_loop_point_in_events_order_and_the_nonfinite_ladder(tmp_path):
    """NaN losses at 8, 9, 10: skip, skip, then a rollback to the newest stable checkpoint from before 8 (5)."""
    fw, s, seen, records, ended = run(tmp_path, {"faults": [{"type": "nan_loss", "step": k} for k in (8, 9, 10)]}, 16)
    assert ended is None and fw.steps == 16
    assert ORDER.fullmatch("".join(LETTER[e] for e in seen)), "".join(LETTER[e] for e in seen)
    assert set(seen) == set(Event)  # (and the guard has one on_<event> per member: test_vocabulary_and_support)
    ev = _events(records)
    assert [e for e in ev if e[0] == "nonfinite"] == [("nonfinite", 8, "skip_step"), ("nonfinite", 9, "skip_step"),
                                                      ("nonfinite", 10, "rollback")]
    (rb,) = [r for r in records if r["event"] == "rollback"]
    assert rb["detail"]["to_step"] == 5 and rb["detail"]["to_tag"] == "step00000005"
    assert all(torch.isfinite(p).all() for p in fw.model.parameters())


def test_a_third_adapter_gets_data_or_weights_from_the_cores_replays(tmp_path):
    """Issue 34: the fake framework hands its micro-batches to the core's ModuleReplays (the replays DeepSpeed's
    adapter uses) and gets what DeepSpeed does: sample 3 of the batches of steps 8-10 poisoned (nan_batch) -- the
    last healthy batch replays finite on the current weights, so the data is to blame: the three steps are skipped
    (where the ladder, without a replay, rolls back at the third: the test above), each record names sample 3 of
    its batch alone (its rows replayed one by one) and the first module that went non-finite."""
    fw, s, seen, records, ended = run(tmp_path, {"faults": [{"type": "nan_batch", "step": k, "sample": 3}
                                                            for k in (8, 9, 10)]}, 16, replays=True)
    assert ended is None and fw.steps == 16
    nonfinite = [r for r in records if r["event"] == "nonfinite"]
    assert [(r["step"], r["action"]) for r in nonfinite] == [(8, "skip_step"), (9, "skip_step"), (10, "skip_step")]
    assert not [r for r in records if r["event"] == "rollback"]
    for r in nonfinite:
        mine, first = r["detail"]["per_rank"]["0"], 8 * (r["step"] - 1)
        assert r["detail"]["weights"]["verdict"] == "healthy"
        assert mine["sample_ids"] == [first + 3] and mine["batch_sample_ids"] == list(range(first, first + 8)), mine
        assert mine["first_nonfinite_module"] == "0", mine  # (the first Linear: its output row 3 is NaN)
    assert all(torch.isfinite(p).all() for p in fw.model.parameters())


def test_a_burst_rolls_back_and_a_ramp_rolls_back_with_the_lr_lowered(tmp_path):
    """instant_burst: a batch x50 at step 14 rolls back at once; rollback_lower_lr (the slow_rise rung,
    here on the burst ladder) also scales the LR by lr_factor for lr_cooldown_steps."""
    fw, s, seen, records, ended = run(tmp_path, {"faults": [{"type": "spike_batch", "step": 14, "factor": 50}]}, 18)
    assert ended is None and ("instant_burst", 14, "rollback") in _events(records)
    (rb,) = [r for r in records if r["event"] == "rollback"]
    assert rb["detail"]["to_step"] == 10 and rb["detail"]["lr_factor"] is None
    fw, s, seen, records, ended = run(tmp_path / "lower", {
        "faults": [{"type": "spike_batch", "step": 14, "factor": 50}],
        "recovery": {"skip_batches": 0, "ladders": {"instant_burst": ["rollback_lower_lr"]}, "lr_cooldown_steps": 100}}, 18)
    (rb,) = [r for r in records if r["event"] == "rollback"]
    assert rb["detail"]["lr_factor"] == 0.5
    assert math.isclose(fw.opt.param_groups[0]["lr"], 1e-2)  # (the scheduled LR is put back after each step)
    assert s.guard.policy.lr_until == 14 + 100 - (14 - 10)  # (the loop goes on from the checkpoint's step, 10)


def test_the_loss_scale_ladder_resets_raises_the_floor_and_falls_back_to_bf16(tmp_path):
    """fp16 overflows at the floor from step 12: the ladder as configured -- reset the scale, raise its floor,
    then continue in bf16 -- each after a rollback that skips no batches."""
    fw, s, seen, records, ended = run(tmp_path, {
        "faults": [{"type": "fp16_overflow", "step": 12, "steps": 30}],
        "recovery": {"skip_batches": 0, "ladders": {"loss_scale": ["rollback", "raise_floor", "bf16_fallback"]}}},
        40, fp16=True)
    assert ended is None and fw.precision == "bf16" and fw.steps == 40
    ev = _events(records)
    scale = [e for e in ev if e[0] in ("loss_scale", "loss_scale_reset", "precision_fallback")]
    assert [e[0] for e in scale] == ["loss_scale", "loss_scale_reset", "loss_scale", "loss_scale_reset",
                                     "loss_scale", "precision_fallback"], scale
    assert [e[2] for e in scale if e[0] == "loss_scale_reset"] == ["reset_scale", "raise_floor"]
    assert all(r["detail"]["skip_batches"] == 0 for r in records if r["event"] == "rollback")
    assert all(torch.isfinite(p).all() for p in fw.model.parameters())
    # the core armed again what depends on the precision (GuardSession.to_bf16): the faults' precision, and the
    # applied-gradient meter on the rebuilt optimizer -- each metric line after the switch says what its update applied
    from trainguard.metrics.jsonl import read

    switched = next(e[1] for e in scale if e[0] == "precision_fallback")
    after = [x for x in read(tmp_path / "tg.jsonl") if x.get("type") == "metric" and x["step"] > switched
             and x.get("applied")]
    assert s.faults.precision == "bf16" and after
    assert all(x["grad_norm_clipped"] is not None and math.isfinite(x["grad_norm_clipped"]) for x in after), after


def test_an_exhausted_budget_aborts_with_the_report_when_asked(tmp_path):
    """One rollback allowed, when_exhausted "abort": the second non-finite rollback aborts, on every rank, with the
    report."""
    fw, s, seen, records, ended = run(tmp_path, {
        "faults": [{"type": "nan_loss", "step": k} for k in (8, 12)],
        "recovery": {"skip_batches": 0, "ladders": {"nonfinite": ["rollback"]}, "max_rollbacks": 1,
                     "when_exhausted": "abort"}}, 20)
    assert isinstance(ended, TrainguardAbort)
    ev = _events(records)
    assert ("nonfinite", 8, "rollback") in ev and ("abort", 12, "abort") in [(e[0], e[1], e[2]) for e in ev]
    assert fw.steps < 20


def test_an_exhausted_budget_trains_on_by_default(tmp_path):
    """The same, by default: the run reaches its end (as the framework would), the second NaN step skipped and
    said, no abort."""
    fw, s, seen, records, ended = run(tmp_path, {
        "faults": [{"type": "nan_loss", "step": k} for k in (8, 12)],
        "recovery": {"skip_batches": 0, "ladders": {"nonfinite": ["rollback"]}, "max_rollbacks": 1}}, 20)
    assert ended is None and fw.steps == 20
    assert all(torch.isfinite(p).all() for p in fw.model.parameters())
    (nf12,) = [r for r in records if r["event"] == "nonfinite" and r["step"] == 12]
    assert nf12["action"] == "skip_step" and "training on" in nf12["detail"]["reason"]
    assert not [r for r in records if r["event"] == "abort"]


def test_without_the_guard_the_session_runs_the_faults_alone():
    """guard_enabled=False (the plain framework under the same faults, for drills): the lr_ramp fault scales the
    LR of its steps on this path too, and the steps count on (no records, no decisions)."""
    cfg = parse_block({**BASE, "faults": [{"type": "lr_ramp", "step": 3, "factor": 2.0, "steps": 2}]})
    fw = TorchFramework(cfg)
    s = GuardSession(fw, cfg, 0, 1, guard_enabled=False)
    assert s.guard is None and s.driver is None
    used = []
    for step in range(1, 6):
        loss = ((fw.model(torch.ones(2, 4)) - 1) ** 2).mean()
        s.loss(step, loss).backward()
        s.step(lambda: used.append(fw.opt.param_groups[0]["lr"]))
        fw.opt.zero_grad()
    assert fw.steps == 5 and used[0] == used[1] == used[4] == 1e-2 and used[2] > 1e-2 and used[3] > used[2]
    s.close({})


def test_a_young_run_that_climbs_restarts_from_its_first_steps_checkpoint(tmp_path):
    """checkpoint.first_step: a fresh run saves after its first step, apart (dir/.first). A climb that begins in a
    young run (here the LR ramped x1.3 a step from step 22: no single jump) goes back there, not to the newest
    periodic save (already trained at the too-high LR), with a tenth of the LR at the loss's best; every periodic
    checkpoint after it is set aside as the abandoned trajectory (trainguard.recovery.lrcut)."""
    fw, s, seen, records, ended = run(tmp_path, {"faults": [{"type": "lr_ramp", "step": 22, "steps": 30, "factor": 1.3}],
                                                 "recovery": {"lr_cooldown_steps": 100}}, 45)
    assert ended is None
    (rb,) = [r for r in records if r["event"] == "rollback"]
    assert rb["detail"]["anomaly"] == "slow_rise" and rb["detail"]["to_step"] == 1
    assert rb["detail"]["from_first_step"] == str(tmp_path / "ck" / ".first") and "young run" in rb["detail"]["reason"]
    assert rb["detail"]["lr_factor"] < 0.5 and "step00000020" in rb["detail"]["abandoned"]
    assert (tmp_path / "ck" / ".first" / "step00000001").is_dir()
    assert all(torch.isfinite(p).all() for p in fw.model.parameters())


def test_no_restart_throws_away_more_steps_than_the_run_has_left(tmp_path):
    """The same young climb in a run whose loop goes on through a rollback and ends soon after (Megatron-LM's
    iteration, HF's global_step: RunFacts.last_step): a restart from step 1 would leave fewer steps to train than it
    throws away (bench/natural's Megatron-LM peers: at 140 of 150, +1302% where plain ended +983%) -- the ordinary
    cut instead, from the newest checkpoint before the climb, and the reason says why. With room enough: the restart."""
    from trainguard.prevent.checks import RunFacts

    def facts(last):
        return RunFacts(dtype="fp32", bf16_supported=False, warmup_steps=None, scheduler=None, framework_clip=0.0,
                        last_step=last)
    block = {"faults": [{"type": "lr_ramp", "step": 22, "steps": 30, "factor": 1.3}],
             "recovery": {"lr_cooldown_steps": 100}}
    fw, s, seen, records, ended = run(tmp_path / "short", block, 45, facts=facts(45))
    assert ended is None and s.lr_history.last_step == 45
    (rb,) = [r for r in records if r["event"] == "rollback"][:1]
    at = rb["step"]
    assert rb["detail"]["to_step"] > 1 and "from_first_step" not in rb["detail"], rb["detail"]
    assert rb["detail"]["lr_factor"] == 0.5
    assert f"it would throw away {at - 1} steps with {45 - at} left" in rb["detail"]["reason"]
    fw, s, seen, records, ended = run(tmp_path / "long", block, 45, facts=facts(1000))
    (rb,) = [r for r in records if r["event"] == "rollback"]
    assert rb["detail"]["to_step"] == 1 and "throw away" not in rb["detail"]["reason"]
    # a young run's bf16 fallback (its LR still rising into the trouble) starts over from step 1 the same way: not
    # where the run ends soon after (the fallback from the newest checkpoint before the trouble instead)
    fw, s, seen, records, ended = run(tmp_path / "fp16", {
        "faults": [{"type": "fp16_overflow", "step": 12, "steps": 30},
                   {"type": "lr_ramp", "step": 2, "steps": 14, "factor": 1.05}],
        "recovery": {"skip_batches": 0}}, 20, fp16=True, facts=facts(20))
    (rb,) = [r for r in records if r["event"] == "rollback"]
    assert ended is None and fw.precision == "bf16" and rb["detail"]["to_step"] > 1
    assert "from_first_step" not in rb["detail"] and "throw away" in rb["detail"]["reason"]


def test_a_creep_named_late_keeps_its_progress_where_going_back_would_cost_more_steps_than_are_left(tmp_path):
    """The driver's side of LrHistory.no_room for an ordinary rollback (bench/natural's Megatron-LM peers: a creep
    named at 140 of 150 went back to 50, ending worse than plain): the climb's rollback (a slow_rise, the LR cut) at
    step 27 of a run ending at 30, with the checkpoint of 20 its target. The loss now no higher than at the save: the
    checkpoint is not loaded, the LR is lowered in place, and the record says why; the loss now above it (the climb
    took the progress back): the rollback goes back to 20 as before."""
    from trainguard.decisions import Decision
    from trainguard.events import Action, Anomaly
    from trainguard.prevent.checks import RunFacts

    facts = RunFacts(dtype="fp32", bf16_supported=False, warmup_steps=None, scheduler=None, framework_clip=0.0,
                     last_step=30)
    done = {}

    def creep(loss_now):
        done.clear()

        def between(session, step):
            if step == 27 and not done:  # (once: a rollback's loop comes back to 27)
                saved = session.driver.fw.checkpointer.saver.losses[20]
                decision = Decision(Action.ROLLBACK, "a creep", lower_lr=True, lr_scale=0.5, onset_step=24,
                                    anomaly=Anomaly.SLOW_RISE, loss=loss_now(saved))
                done["loaded"] = session.driver.rollback(step, decision)
                done["lr"] = session.driver.lr_multiplier(28)
        return between

    fw, s, seen, records, ended = run(tmp_path / "kept", {}, 30, facts=facts, between=creep(lambda saved: saved))
    assert ended is None and fw.steps == 30 and done == {"loaded": False, "lr": 0.5}
    (un,) = [r for r in records if r["event"] == "rollback_unavailable"]
    assert un["step"] == 27 and not [r for r in records if r["event"] == "rollback"]
    assert un["detail"]["reason"] == ("no rollback to step 20: it would throw away 7 steps with 3 left (the run "
                                      "ends at step 30): the LR lowered in place") and un["detail"]["lr_factor"] == 0.5
    fw, s, seen, records, ended = run(tmp_path / "back", {}, 30, facts=facts, between=creep(lambda saved: 2 * saved))
    (rb,) = [r for r in records if r["event"] == "rollback"]
    assert done["loaded"] and rb["step"] == 27 and rb["detail"]["to_step"] == 20
    # never for what the creep came with: a burst (or a non-finite value) among the verdicts, or a rung that lowers
    # no LR (the slow_rise ladder set to a plain "rollback": nothing would be done at all)
    from trainguard.verdicts import Verdict

    burst = Verdict(detector="loss_spike", anomaly="instant_burst", ranks=[0], detail={})
    for name, change in (("burst", {"verdicts": (burst,)}), ("plain", {"lower_lr": False, "lr_scale": None})):
        def with_it(session, step, change=change):
            if step == 27 and not done:
                saved = session.driver.fw.checkpointer.saver.losses[20]
                done["loaded"] = session.driver.rollback(step, Decision(
                    Action.ROLLBACK, "a creep", **{"lower_lr": True, "lr_scale": 0.5, **change}, onset_step=24,
                    anomaly=Anomaly.SLOW_RISE, loss=saved))
        done.clear()
        fw, s, seen, records, ended = run(tmp_path / name, {}, 30, facts=facts, between=with_it)
        assert done["loaded"] and [r["detail"]["to_step"] for r in records if r["event"] == "rollback"] == [20], name


def test_a_rollback_decision_carries_the_loss_it_was_decided_at(tmp_path):
    """What the no-room rule compares a checkpoint's loss with (trainguard.recovery.room.keeps_progress): the
    judgement puts the step's loss -- or the loss window's median, when higher -- on every rollback it decides."""
    taken = []

    def between(session, step):
        last = session.guard.judgement.last
        if last is not None and last.action.value == "rollback":
            taken.append((last.loss, session.guard.stats.loss_median()))
    fw, s, seen, records, ended = run(tmp_path, {"faults": [{"type": "nan_loss", "step": k} for k in (8, 9, 10)]}, 16,
                                      between=between)
    assert [r["step"] for r in records if r["event"] == "rollback"] == [10]
    assert [loss for loss, _ in taken] == [None]  # (a non-finite step's loss is no loss: none carried, none asked)
    taken.clear()
    fw, s, seen, records, ended = run(tmp_path / "climb", {"faults": [{"type": "lr_ramp", "step": 22, "steps": 30,
                                                                       "factor": 1.3}]}, 45, between=between)
    (rb,) = [r for r in records if r["event"] == "rollback"][:1]
    # (the window is read after the step: a restart from the first step empties it)
    assert taken and all(loss is not None and loss > 0 and (median is None or loss >= median) for loss, median in taken)


def test_a_restart_from_the_first_step_starts_the_loss_and_norm_windows_again(tmp_path):
    """After going back to step 1, the early losses are high against the later ones the windows held: they
    must not read as a burst (bench/natural: a climb detected at step 241 restarted, then the loss of step 2
    was an instant_burst, and the run aborted at the LR floor)."""
    fw, s, seen, records, ended = run(tmp_path, {"faults": [{"type": "lr_ramp", "step": 22, "steps": 30, "factor": 1.3}],
                                                 "recovery": {"lr_cooldown_steps": 100}}, 60)
    assert ended is None
    (rb,) = [r for r in records if r["event"] == "rollback"]
    after = [r for r in records if r["time"] > rb["time"] and r.get("action") not in (None, "alert", "warn")]
    assert after == [], [(r["step"], r["event"]) for r in after]
    # (this toy loop's early losses are not far above its late ones; the reset itself:)
    from trainguard.detectors.loss_spike import LossSpikeDetector
    from trainguard.config import LossSpikeConfig

    det = LossSpikeDetector(LossSpikeConfig(min_history=3))
    for x in (1.0, 1.01, 0.99, 1.0):
        assert det.observe(1, x, None, 0.0) is None
    assert det.observe(2, 4.8, None, 0.0).anomaly == "instant_burst"
    det.reset()
    assert det.observe(2, 4.8, None, 0.0) is None and len(det.window) == 1


def test_a_young_runs_bf16_fallback_starts_over_from_its_first_step_and_keeps_one_to_restart_from(tmp_path):
    """fp16 overflowing at the floor in a young run while its LR still rises (bench/natural: fp16 during a warmup to
    a peak LR of 0.1): the bf16 fallback goes back to the first step's checkpoint, not to the newest periodic one
    (trained in fp16 at the trouble), and the first step's checkpoint is saved again in bf16 -- the fp16 one would
    not load into the bf16 engine, so a later climb could not restart from it (it ended 151% above healthy; 1.6%
    now). With a steady LR the fallback goes to the newest checkpoint before the trouble, as before."""
    fw, s, seen, records, ended = run(tmp_path / "steady", {
        "faults": [{"type": "fp16_overflow", "step": 12, "steps": 30}], "recovery": {"skip_batches": 0}}, 40, fp16=True)
    (rb,) = [r for r in records if r["event"] == "rollback"]
    assert ended is None and rb["detail"]["to_step"] == 10 and "from_first_step" not in rb["detail"]
    fw, s, seen, records, ended = run(tmp_path, {  # (a warmup under way: the LR x1.05 a step from step 2)
        "faults": [{"type": "fp16_overflow", "step": 12, "steps": 30},
                   {"type": "lr_ramp", "step": 2, "steps": 14, "factor": 1.05}],
        "recovery": {"skip_batches": 0}}, 40, fp16=True)
    assert ended is None and fw.precision == "bf16" and fw.steps == 40
    (rb,) = [r for r in records if r["event"] == "rollback"]
    assert rb["detail"]["anomaly"] == "loss_scale" and rb["detail"]["to_step"] == 1
    assert rb["detail"]["from_first_step"] == str(tmp_path / "ck" / ".first") and "young run" in rb["detail"]["reason"]
    fb = next(r for r in records if r["event"] == "precision_fallback")
    again = [r for r in records if r["event"] == "checkpoint_saved" and r["time"] >= fb["time"]
             and r["detail"]["dir"].endswith(".first")]
    assert [r["detail"]["tag"] for r in again] == ["step00000001"]
    # the policy may still restart a later climb once (the bf16 start-over is not the LR's: its loss never climbed)
    assert not s.guard.policy.restarted and s.guard.policy.lr_factor == 1.0
    # the main directory's own checkpoint of step 1 (the fallback's, in bf16) keeps its watch: it became stable there
    assert (tmp_path / "ck" / "step00000001" / "stable.json").is_file()
    assert not (tmp_path / "ck" / ".first" / "step00000001" / "stable.json").exists()


def test_a_young_runs_bf16_start_over_whose_loss_climbed_as_its_lr_rose_cuts_the_lr_too(tmp_path):
    """A held-out draw (s5020: a wide head at 50x in fp16) climbed from its first loss as its warmup rose, before the
    loss trend could speak, then overflowed fp16; restarted in bf16 at the same LR it stood at its first level for
    good (+341% against healthy). Where the loss climbed more than ``rise`` above where it began as the LR rose, before
    the fp16 trouble, the start-over also cuts the LR to a tenth of the LR where the loss stopped falling (the LR range
    test's rule), for the rest of the run -- and that restart is the LR's (once a run)."""
    def climbed(session, step):  # (this toy's batches wander by more than a fifth from one to the next: its own loss
        # never makes an early climb -- trainguard.detectors.early_climb's rule is held on real series in
        # tests/unit/test_loss_trend.py; here what it would name: a climb from where the run began, at step 3, seen at
        # step 10 as the LR rose, and standing since)
        if step == 10:
            early = session.guard.stats.loss_trend.early
            early.start, early.climb, early.rose = (3, 0.3), (3, 10), True
    fw, s, seen, records, ended = run(tmp_path, {
        "faults": [{"type": "fp16_overflow", "step": 12, "steps": 30},
                   {"type": "lr_ramp", "step": 2, "steps": 14, "factor": 1.05}],
        "recovery": {"skip_batches": 0}}, 40, fp16=True, between=climbed)
    assert ended is None and fw.precision == "bf16" and fw.steps == 40
    (rb,) = [r for r in records if r["event"] == "rollback"]
    assert rb["detail"]["anomaly"] == "loss_scale" and rb["detail"]["to_step"] == 1 and "from_first_step" in rb["detail"]
    assert "range test" in rb["detail"]["reason"] and rb["detail"]["lr_factor"] < 0.1
    policy = s.guard.policy
    assert policy.restarted and policy.lr_factor == policy.lr_lasting == rb["detail"]["lr_factor"]
    # a warmup of one step (the LR flat from its start: not "still rising" into the trouble) whose loss climbed above
    # where it began: the start-over from the first step too, a tenth of the LR the loss climbed at (a held-out draw,
    # s5032: 25x in one step, fp16's scale collapsed at 63 and the fallback in place kept the broken LR: +298%)
    fw, s, seen, records, ended = run(tmp_path / "flat", {"faults": [{"type": "fp16_overflow", "step": 12, "steps": 30}],
                                                          "recovery": {"skip_batches": 0}}, 40, fp16=True, between=climbed)
    (rb,) = [r for r in records if r["event"] == "rollback"]
    assert ended is None and rb["detail"]["to_step"] == 1 and abs(rb["detail"]["lr_factor"] - 0.1) < 1e-9
    fw, s, seen, records, ended = run(tmp_path / "flat-quiet", {  # (without the climb: the fallback as before)
        "faults": [{"type": "fp16_overflow", "step": 12, "steps": 30}], "recovery": {"skip_batches": 0}}, 40, fp16=True)
    (rb,) = [r for r in records if r["event"] == "rollback"]
    assert rb["detail"]["to_step"] == 10 and rb["detail"]["lr_factor"] is None
    fw, s, seen, records, ended = run(tmp_path / "decay", {  # (the LR fell since: not the LR the loss climbed at)
        "faults": [{"type": "fp16_overflow", "step": 12, "steps": 30},
                   {"type": "lr_ramp", "step": 4, "steps": 10, "factor": 0.9}],
        "recovery": {"skip_batches": 0}}, 40, fp16=True, between=climbed)
    (rb,) = [r for r in records if r["event"] == "rollback"]
    assert rb["detail"]["to_step"] == 10 and rb["detail"]["lr_factor"] is None
    # without the first step's checkpoint: the bf16 fallback to the newest checkpoint before the trouble, as before --
    # the cut goes with the restart it was sized for
    fw, s, seen, records, ended = run(tmp_path / "none", {
        "faults": [{"type": "fp16_overflow", "step": 12, "steps": 30},
                   {"type": "lr_ramp", "step": 2, "steps": 14, "factor": 1.05}],
        "checkpoint": {"first_step": False}, "recovery": {"skip_batches": 0}}, 40, fp16=True, between=climbed)
    (rb,) = [r for r in records if r["event"] == "rollback"]
    assert ended is None and fw.precision == "bf16" and "from_first_step" not in rb["detail"]
    assert "an ordinary rollback" in rb["detail"]["reason"] and rb["detail"]["lr_factor"] is None
    assert not s.guard.policy.restarted and s.guard.policy.lr_factor == 1.0


def test_the_first_steps_checkpoint_is_removed_once_the_run_is_grown(tmp_path):
    """checkpoint.first_step: kept while a climb that began young can still be seen, then removed -- also when the
    run was resumed past that step (a resumed run never sees its step 1 again)."""
    fw, s, seen, records, ended = run(tmp_path, {}, 11)
    assert (tmp_path / "ck" / ".first" / "step00000001").is_dir()
    cp, h = s.driver.fw.checkpointer, s.lr_history
    assert h.ramp_end is None and not h.grown(11)  # (its LR has not held yet)
    h.ramp_end = 500  # (a warmup of 500 steps, as a resumed run's guard state would say): still young at 400
    cp.after_step(400)
    assert (tmp_path / "ck" / ".first" / "step00000001").is_dir()
    h.ramp_end = 1  # (no warmup): grown once past twice the loss trend's settling time, and that time again
    cp.after_step(3 * h.settle)
    assert (tmp_path / "ck" / ".first" / "step00000001").is_dir()
    cp.after_step(3 * h.settle + 1)  # (as a run resumed there would)
    assert not (tmp_path / "ck" / ".first").exists()
    assert not [p for p in (tmp_path / "ck").iterdir() if p.name.startswith(".first")]


def test_a_new_run_in_the_same_folder_never_appends_to_the_earlier_runs_log(tmp_path, monkeypatch):
    """Issue 53: a second run in the same folder appended to the first one's JSONL (and the report then told two
    runs as one). A fresh start in its first attempt is a new run: the earlier lines are moved to a file of their own
    beside the log, named in ``fresh_start``; a run that resumes (the same run, going on) still appends, and so does
    one entered again in the same process (a spare's re-entry: its log was this process's already)."""
    from pathlib import Path

    from trainguard.metrics import jsonl
    from trainguard.metrics.jsonl import read

    run(tmp_path, {"checkpoint": {"resume": "none"}}, 4)
    run(tmp_path, {"checkpoint": {"resume": "none"}}, 2)  # entered again in this process: the same run's log
    assert not list(tmp_path.glob("tg.before-*"))
    monkeypatch.setattr(jsonl, "_OPENED", set())  # (a new process: another run)
    _, _, _, records, _ = run(tmp_path, {"checkpoint": {"resume": "none"}}, 6)
    starts = [r for r in records if r["event"] == "run_start"]
    (fresh,) = [r for r in records if r["event"] == "fresh_start"]
    earlier = Path(fresh["detail"]["earlier_log"])
    assert len(starts) == 1 and earlier.parent == tmp_path and earlier.name.startswith("tg.before-")
    before = [x for x in read(earlier) if x.get("type") == "event"]
    assert [r["event"] for r in before].count("run_start") == 2 and before[-1]["event"] == "run_end"
    _, _, _, records, _ = run(tmp_path, {}, 8)  # resumes the second run's step-5 checkpoint: its log goes on
    assert [r["event"] for r in records].count("run_start") == 2 and len(list(tmp_path.glob("tg.before-*"))) == 1


def test_without_a_checkpoint_dir_a_new_run_sets_the_earlier_log_aside_at_its_first_step(tmp_path, monkeypatch):
    """Issue 53: with no ``checkpoint.dir`` (HF's Trainer, Megatron-LM with its own --save) nothing of trainguard's
    decided the start, and a second run appended to the first one's log. The first step this process trains says it:
    step 1 in the job's first attempt is a new run (earlier lines set aside, a ``fresh_start`` names where); a first
    step later than 1 is a resume of the framework's own checkpoint (the log goes on); a restarted attempt too."""
    from pathlib import Path

    from trainguard.observe.eventlog import EventLog
    from trainguard.metrics import jsonl
    from trainguard.metrics.jsonl import read

    cfg = parse_block({"metrics": {"jsonl": str(tmp_path / "tg.jsonl"), "console": False}})
    log = tmp_path / "tg.jsonl"

    def start(first_step, env=None):
        monkeypatch.setattr(jsonl, "_OPENED", set())  # (each a new process)
        for k, v in (env or {}).items():
            monkeypatch.setenv(k, v)
        ev = EventLog(0)
        ev.open(cfg)
        ev.first_step(first_step)
        ev.metric(first_step, {"loss": 1.0})
        ev.first_step(first_step + 1)  # (said once)
        ev.close()

    start(1)
    assert not list(tmp_path.glob("tg.before-*"))  # (nothing earlier)
    start(501)  # the framework resumed its own checkpoint: the same run goes on
    assert not list(tmp_path.glob("tg.before-*")) and [r["step"] for r in read(log)] == [1, 501]
    start(1, {"TORCHELASTIC_RESTART_COUNT": "1"})  # a restarted attempt: the same job
    assert not list(tmp_path.glob("tg.before-*"))
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    start(1)  # a new run
    (earlier,) = tmp_path.glob("tg.before-*")
    assert [r["step"] for r in read(earlier)] == [1, 501, 1]
    rows = list(read(log))
    (fresh,) = [r for r in rows if r.get("event") == "fresh_start"]
    assert Path(fresh["detail"]["earlier_log"]) == earlier and [r["step"] for r in rows if r["type"] == "metric"] == [1]


def test_a_watchdog_that_fails_to_stop_costs_neither_the_last_save_nor_the_run_end(tmp_path, monkeypatch):
    """CLOSE stopped the watchdog first: one that raised there left the hooks in, the last save uncommitted and no
    run_end. It is said in run_end's ``watchdog`` now, and the rest of CLOSE happens."""
    class Broken:  # (the watchdog's stop, failing: a single process here has no watchdog of its own)
        def stop(self):
            raise OSError("the heartbeat folder is gone")

    monkeypatch.setattr(GuardSession, "start_watchdog", lambda self: setattr(self, "watchdog", Broken()))
    fw, s, _, records, ended = run(tmp_path, {"checkpoint": {"every_steps": 3}}, 6)
    (end,) = [r for r in records if r["event"] == "run_end"]
    assert ended is None and "OSError" in end["detail"]["watchdog"]["stop_failed"] and not s.hooks
    assert (tmp_path / "ck" / "step00000006").is_dir() and not list((tmp_path / "ck").glob(".staging/*"))


def test_a_young_runs_cut_without_its_first_steps_checkpoint_is_the_ordinary_one_for_the_cooldown(tmp_path):
    """No first step's checkpoint to restart from (``checkpoint.first_step`` off here; no ``checkpoint.dir`` takes the
    same branch): an ordinary rollback with ``lr_factor``, which expires with its cooldown -- a tenth kept for good
    would compound at each later young verdict."""
    fw, s, seen, records, ended = run(tmp_path, {"faults": [{"type": "lr_ramp", "step": 22, "steps": 30, "factor": 1.3}],
                                                 "recovery": {"lr_cooldown_steps": 100},
                                                 "checkpoint": {"first_step": False}}, 45)
    assert ended is None
    (rb,) = [r for r in records if r["event"] == "rollback"]
    assert rb["detail"]["lr_factor"] == 0.5 and "for the cooldown" in rb["detail"]["reason"]
    policy = s.guard.policy
    assert policy.lr_lasting == 1.0 and policy.lr_applied(10_000) == 1.0


def test_an_asynchronous_saves_manifest_says_the_health_of_its_step_not_of_its_commit(tmp_path):
    """An asynchronous save commits steps after it began; its manifest's health (the loss a rollback's no-room rule
    and `trainguard ckpt diff` read) is the step's it holds, as the save began (a reviewer: it was the commit's)."""
    import json

    import pytest

    from trainguard.metrics.jsonl import read

    fw, s, seen, records, ended = run(tmp_path, {"checkpoint": {"async": True}}, 30)
    assert ended is None
    loss = {m["step"]: m["loss"] for m in read(tmp_path / "tg.jsonl") if m.get("type") == "metric"}
    kept = 0
    for tag in sorted((tmp_path / "ck").glob("step*")):
        man = json.loads((tag / "manifest.json").read_text())
        step = man["step"]
        assert man["health"]["loss"] == pytest.approx(loss[step], rel=1e-6), (step, man["health"], loss[step])
        assert fw.checkpointer.saver.losses[step] <= man["health"]["loss"]
        kept += 1
    assert kept >= 3
