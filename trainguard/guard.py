"""The per-step state machine: the loop points of :class:`trainguard.events.Event`, in order.

Framework-free: an adapter (``ds_plugins``, ``megatron_hooks``) calls ``on_<event>`` at the right
moments of its framework's loop and carries out the action it gets back from ``on_decide``. The
guard never imports a framework and never touches an optimizer.

Cost on a healthy, unsampled step: a few device-side ops per micro-batch (loss flag) and per
parameter gradient (a norm added into one scalar), the step's agreement (trainguard.agreement: every
rank's row up to 64 ranks, a fixed-size summary above), and one host synchronisation to read it. The framework's global gradient norm of a step rides in
the *next* step's table (so reading it costs no second sync), which is why a metric line is written
one step late. Sampled steps (probes), anomaly steps and steps where the sanitiser set samples aside
add one object gather (sample ids, probe statistics, localisation; above 64 ranks from the named ranks only).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from trainguard import records
from trainguard.checks import RunFacts, start_checks
from trainguard.clipping import Clipper
from trainguard.config import TrainguardConfig
from trainguard.data import DataPosition
from trainguard.detectors.loss_scale import LossScaleWatch
from trainguard.verdicts import ScalerState
from trainguard.detectors.loss_spike import LR_LOOKBACK
from trainguard.lrcut import LrHistory
from trainguard.detectors.lineup import Lineup
from trainguard.detectors.registry import Decide
from trainguard.detectors.straggler import StragglerDetector
from trainguard.attribution import by_rank, culprit_samples
from trainguard.errors import TrainguardAbort
from trainguard.events import Action, Event, Record
from trainguard.evidence import Evidence
from trainguard.faults import FaultInjector
from trainguard.goodput import GoodputMeter
from trainguard.agreement import Agreement, StepView
from trainguard.isolation import RankCoords
from trainguard.metricline import DeferredLine, step_line
from trainguard.policy import Decision, Policy, anomaly_class
from trainguard.probes import SampledProbes
from trainguard.replay import MicroBatch
from trainguard.replays import Replays
from trainguard.steplog import StepLog
from trainguard.steptime import StepTimer
from trainguard.tally import StepTally
from trainguard.suspects import SuspectWatch

ALERT = records.ALERT


class StepGuard:
    """One per rank. ``group`` is the process group the AGREE collective runs on (None: world).

    ``localize`` (from the adapter): trainguard.evidence.Evidence's.
    ``replay`` (from an adapter that can): ``replay(micro_batch, row)`` -> the loss of one recorded
    micro-batch (``row`` None) or of one of its rows, replayed on the current weights
    (trainguard.replay); ``narrow_rows``: whether the culprit's rows may be replayed one by one (not under
    ZeRO-3, whose forwards gather every rank's parameters); ``replay_peers``: the ranks that replay together
    with this one (a model-parallel group, whose forwards are collective: each of them narrows when any of
    them is a culprit, in lockstep; their replays return the same losses); default this rank alone.
    """

    def __init__(self, cfg: TrainguardConfig, rank: int, world: int, group=None,
                 device: torch.device | str = "cpu", localize: Callable[[], dict] | None = None,
                 replay: Callable[[MicroBatch, int | None], float | None] | None = None, narrow_rows: bool = False,
                 replay_peers: Sequence[int] | None = None, peer_replay: Callable[[Any, int], tuple] | None = None,
                 collective=None, policy: Policy | None = None, goodput: GoodputMeter | None = None,
                 faults: FaultInjector | None = None, clipper: Clipper | None = None):
        self.cfg = cfg
        self.device = torch.device(device)
        self.rank, self.world, self.group = rank, world, group
        # (the parts others act on too -- the policy's ladders and LR cooldown, the goodput meter, the fault
        # injector -- are the session's, handed to each that needs them: trainguard.session)
        self.policy = policy if policy is not None else Policy(cfg.detectors.nonfinite, cfg.recovery)
        self.faults = faults if faults is not None else FaultInjector(cfg.faults, rank)
        self.lr_now: float | None = None  # this rank's LR of the coming update (the driver sets it before AGREE)
        self.lr_history = LrHistory()     # the LR each recent step used (rank 0's): the LR cut's evidence
        self.loss_scale = LossScaleWatch(cfg.detectors.loss_scale)
        self.goodput = goodput if goodput is not None else GoodputMeter()
        self._scaled = False  # an fp16 loss scale is on (set at AGREE)
        self.clipper = clipper if clipper is not None else Clipper(cfg.clipping)
        self.detectors = Lineup(cfg, self.device)  # the registered ones and yours (trainguard.detectors.lineup)
        self.stats = self.detectors.stats  # (the statistics' windows: a healthy loss, the loss median, a rise's onset)
        exchanging = self.detectors.exchanging
        self.replays = Replays(replay if cfg.recovery.replay_check else None, peer_replay if exchanging else None,
                               narrow_rows and replay is not None and cfg.recovery.narrow_samples,
                               set(replay_peers) if replay_peers is not None else {rank}, self.stats.healthy_loss,
                               cfg.recovery.enabled)
        self.book = self.replays.book  # this step's micro-batches and the last healthy one (what an adapter replays)
        self.probes = SampledProbes(cfg.detectors)  # activation range, attention entropy: on their sampled steps
        self.coords: list[RankCoords] = []
        self.log = StepLog(rank, cfg, self.coords_of)  # records and incidents (trainguard.steplog)
        self.events = self.log.events
        self.skipped_steps = 0      # steps the guard skipped (the framework's own count is separate)
        self.last_decision: Decision | None = None
        self.last_step = 0
        self.last_metrics: dict = {}            # the last metric line (for checkpoint health)
        self.recent_anomalies: list = []        # (step, anomaly) of recent verdicts
        self.culprit_samples: dict[int, list[int]] = {}
        self.suspects = SuspectWatch(cfg.recovery.suspect_after, rank, cfg.metrics.jsonl, self.coords_of, world)
        self._everyone: dict[int, dict] | None = None  # the last anomaly step's object gather ({rank: values})
        self._probe_values: dict = {}
        self.deferred = DeferredLine(self.events, self.clipper)  # the previous step's line, awaiting its norm
        self.timer = StepTimer(self.device)  # this rank's own time per step (the straggler detector's input)
        self.straggler = StragglerDetector(cfg.detectors.straggler)
        # the step's collectives (trainguard.agreement: every rank's rows up to 64 ranks, a fixed-size summary above)
        self.agreement = Agreement(rank, world, self.device, group, collective, extra=self.detectors.columns)
        self.evidence = Evidence(cfg, rank, self.device, group, self.detectors, self.probes, self.replays,
                                 self.agreement, localize)  # (DECIDE's first half: trainguard.evidence)
        self._reset_step()

    # ------------------------------------------------------------------ helpers
    def _reset_step(self) -> None:
        self.tally = StepTally(self.device)  # this step's micro-batch accumulators (trainguard.tally)

    @property
    def checking(self) -> bool:
        return self.cfg.detectors.nonfinite.enabled

    def attach_model(self, model: torch.nn.Module) -> None:
        """Choose the modules the sampled probes watch (hooks are added only on sampled steps); hand the model
        to the registered detectors."""
        self.detectors.attach_model(model)
        self.probes.attach(model)

    def sampled(self, step: int) -> list[str]:
        return self.probes.sampled(step)

    def probing(self, step: int):
        """Around the model's forward: opens the probes on sampled steps, else does nothing."""
        return self.probes.probing(step)

    def clip_limit(self) -> float | None:
        """The max-norm to hand the framework for the coming step (None: leave it)."""
        return self.clipper.max_norm()

    def coords_of(self, rank: int) -> dict:
        return self.coords[rank].as_dict() if rank < len(self.coords) else {"rank": rank}

    def mirror(self, make: Callable[[list], Any]) -> None:
        """Another sink for the records: ``make(every rank's coordinates)`` (trainguard.session.GuardSession.mirror)."""
        self.events.mirrors.append(make(self.coords))

    def emit(self, step: int, record: Record, ranks=(), action: str | None = None, detail: dict | None = None,
             rank_local: bool = False, **extra) -> None:
        """Write one record (trainguard.eventlog.EventLog.emit): the one way anything is logged."""
        self.log.emit(step, record, ranks, action, detail, rank_local=rank_local, **extra)

    # ------------------------------------------------------------------ loop points
    def on_begin(self, coords: Sequence[RankCoords], framework: dict[str, Any], facts: RunFacts | None = None) -> None:
        """BEGIN: coordinates of every rank are known; open the logs; record the run's identity;
        run the start-of-run checks."""
        self.coords = list(coords)
        self.suspects.begin(self.coords)
        self.events.open(self.cfg)
        if self.rank == 0:
            self.log.run_start(self.world, self.coords, framework, self.probes, self.agreement,
                               self.detectors.rows_every_step)
        if facts is not None:
            for v in start_checks(facts, self.cfg):
                self.emit(0, Record(v.anomaly), [], "warn", v.detail)
        self.timer.start()

    def on_batch(self, sample_ids: list[int], position: DataPosition, rejected: Sequence = ()) -> None:
        """BATCH: the loader handed out a micro-batch with these dataset indices (and set these aside)."""
        self.tally.batch(sample_ids, position, rejected)

    def on_forward(self, step: int, inputs: Any) -> tuple[Any, bool]:
        """FORWARD: faults may poison the inputs. Returns ``(inputs, poison_first_module_output)``.
        The adapter runs the forward inside :meth:`probing`."""
        return self.faults.batch(step, inputs)

    def on_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """LOSS: the loss handed to backward. Device-side flags only: no host sync here."""
        loss = self.faults.loss(step, loss)
        self.tally.loss(loss, self.checking)
        return loss

    def on_backward(self, grad: torch.Tensor) -> None:
        """BACKWARD: a tensor hook per parameter, fired with the *local* gradient before any
        data-parallel reduction. Adds its squared norm into one device scalar (NaN/Inf propagate)."""
        if grad is None:
            return
        self.tally.grad(grad)  # (one reduction kernel per gradient; combined once, at AGREE)

    def on_agree(self, step: int, loss_scale: float = 1.0, grad_divisor: float = 1.0,
                 dynamic_scale: bool = False) -> StepView:
        """AGREE: the step's collectives (trainguard.agreement). Every rank calls it at every optimizer step.
        ``dynamic_scale``: an fp16 dynamic loss scaler is on (gradient overflows are then its routine)."""
        row = self.tally.row(self.agreement, self.faults.fired_in(step), self.timer.take(), self.lr_now, self.deferred)
        self.detectors.local(step, row)
        view = self.agreement.agree(row, loss_scale, grad_divisor, want_rows=self.detectors.wants_rows(step))
        self._scaled = dynamic_scale
        self.deferred.flush(view.summary.prev_grad_norm, view.summary.prev_applied_sq)
        return view

    def on_decide(self, step: int, obs: StepView) -> Decision:
        """DECIDE: pure detectors -> policy -> one action, identical on every rank. The registered detectors
        (trainguard.detectors.registry) read the step's summary (trainguard.reduced), the rows where they travelled,
        and -- after the one object gather of an anomaly or sampled step -- the named ranks' objects."""
        s = obs.summary
        ctx = Decide(obs, self.coords, scaled=self._scaled, lr=self.lr_history.agree(s.lr),
                     lr_ratio=lambda: self.lr_history.ratio(step, LR_LOOKBACK))
        everyone = self.evidence.gather(step, ctx, self.tally, lambda at, r, why: self.suspects.suspect(
            at, r, why, self.emit))
        verdicts = ([ctx.nonfinite] if ctx.nonfinite is not None else []) + ctx.found
        custom = self.detectors.custom_verdicts(step, s, ctx.rows)
        rise_onset = self.stats.rise_onset(step)
        lr_cut = None
        if self.cfg.recovery.lr_cut == "evidence":
            def lr_cut(onset: int) -> tuple[float, str, bool]:
                return self.lr_history.cut(onset, step, self.cfg.recovery.lr_factor)
        decision = self.policy.decide(verdicts, step, rise_onset, weights=self.weights, fp16=self._scaled,
                                      lr_cut=lr_cut, lr_rising=self.lr_history.rising_into)
        self.last_decision = decision
        # damaged weights, not data: no sample is to blame
        self.culprit_samples = culprit_samples(decision, everyone) if self.weights != "damaged" else {}
        # (every rank whose own loss was not healthy fails with the culprits: a failure they share names no host;
        # judged on anomaly steps only -- each judgement sorts the loss window)
        unhealthy = self.stats.unhealthy(obs) if verdicts else []
        self.suspects.observe(step, self.culprit_samples, self.emit, failing=unhealthy)
        if verdicts:
            self.recent_anomalies = (self.recent_anomalies + [[step, v.anomaly] for v in verdicts])[-20:]
        self._everyone = everyone
        # every rank's sampled values (they came with the gather above: no extra synchronisation)
        self._probe_values = {k: by_rank(everyone, k) if ctx.probed[k] is not None else None
                              for k in ("activation", "entropy")}
        self.log.decided(step, obs, decision, verdicts, everyone, self.skipped_steps, self.replays.check)
        if self.cfg.detectors.straggler.enabled:
            self._log_stragglers(step, obs)
        self.log.custom_alerts(step, custom)
        return decision

    # ------------------------------------------------------------------ replays (trainguard.replays)
    @property
    def wants_batches(self) -> bool:
        """Whether the adapter should hand its training micro-batches to :meth:`record_micro_batch`."""
        return self.replays.wants_batches

    def peer_sampled(self, step: int) -> bool:
        """Whether a peer replays this step's last micro-batch (detectors.peer_replay): the adapter may then keep
        the random-number state its training forward starts from and that forward's values (:meth:`measured`)."""
        return self.replays.peer_replay is not None and self.detectors.sampled(step)

    def measured(self, rng: Any, value: Any) -> None:
        """The last recorded micro-batch's RNG state before its training forward, and that forward's (loss, output
        digest) as device values (read at DECIDE of a sampled step only)."""
        self.replays.measured(rng, value)

    def record_micro_batch(self, inputs: Any, rows: int | None) -> None:
        """The adapter hands each training micro-batch it can replay (after BATCH named its samples)."""
        self.replays.record(inputs, self.tally.take_ids(), rows)

    @property
    def weights(self) -> str | None:
        """This step's weights check: "healthy" (the data was to blame), "damaged", or None (none made)."""
        return self.replays.weights

    def on_step(self, step: int, decision: Decision, applied: bool,
                scaler: ScalerState | None = None) -> Decision | None:
        """STEP: the adapter applied or skipped the optimizer step; check it did what was decided.

        ``scaler`` (fp16 with a dynamic loss scale): the scaler as it was when the step began. A
        collapse (overflow at the minimum scale, or an endless overflow streak) returns the
        ``loss_scale`` ladder's decision, which the adapter carries out now; otherwise None."""
        self._check_applied(step, decision, applied)
        if scaler is None or not self.cfg.detectors.loss_scale.enabled:
            return None
        verdict = self.loss_scale.observe(step, scaler, overflowed=not applied)
        if verdict is None:
            return None
        scale_decision = self.policy.decide_loss_scale(verdict, step, lr_rising=self.lr_history.rising_into)
        self.log.verdict(step, verdict, scale_decision, None, self.skipped_steps, self.replays.check)
        return scale_decision

    def _check_applied(self, step: int, decision: Decision, applied: bool) -> None:
        if decision.action in (Action.SKIP_STEP, Action.ROLLBACK):
            if applied:
                raise RuntimeError(f"rank {self.rank}: step {step} was decided SKIP_STEP but the framework "
                                   "applied it; this optimizer is not supported by the skip path")
            self.skipped_steps += 1
        elif decision.action is Action.CONTINUE and not applied:
            self.log.framework_skip(step)

    def on_end(self, step: int, obs: StepView, metrics: dict[str, Any]) -> None:
        """END: the metric line(s) of this step, written once the framework's global gradient norm
        arrives with the next table (``metrics["grad_norm"]`` may be a device tensor)."""
        self.last_step = step
        norm = metrics.pop("grad_norm", None)
        limit = metrics.pop("clip_limit", None)
        applied_sq = metrics.pop("applied_grad_sq", None)
        due = self.line_due(step)
        line = step_line(obs, metrics, self.stats.loss_median(),
                         self.skipped_steps, self.straggler.last, self._probe_values)
        me = obs.own
        rank_line = None
        if me is not None and self.events.rank_log is not None:
            rank_line = {"rank": self.rank, "local_loss": me.loss, "local_grad_norm": me.grad_norm,
                         "sample_ids": self.tally.sample_ids, "position": self.tally.where()}
        self.faults.step_done(step)
        d = self.last_decision
        self.book.step_ended(bool(metrics.get("applied", True)) and d is not None and d.action is Action.CONTINUE
                             and not any(anomaly_class(v) for v in d.verdicts))
        self.last_metrics = line
        self.deferred.hold(step, line, rank_line, due, limit, metrics.get("applied", True), norm, applied_sq)
        self._probe_values = {}
        self.log.close_incidents(step)
        self._reset_step()
        self.timer.start()  # (the next step's own time counts from here)

    def line_due(self, step: int) -> bool:
        """Whether this step's metric line is written (known once DECIDE has run)."""
        return step % self.cfg.metrics.every_steps == 0 or (
            self.last_decision is not None and self.last_decision.action is not Action.CONTINUE)

    def on_close(self, totals: dict[str, Any] | None = None) -> None:
        """CLOSE: the last metric line, totals, then close the files."""
        self.deferred.close(self.world)
        self.log.run_end(self.last_step, self.world, {"guard_skipped_steps": self.skipped_steps,
                                                      "nonfinite_steps": self.policy.total_nonfinite, **(totals or {})})

    # ------------------------------------------------------------------ records
    def forward_done(self) -> None:
        """The adapter's forward returned (each micro-batch; the last one of the step counts)."""
        self.timer.mark()

    def _log_stragglers(self, step: int, obs: StepView) -> None:
        self.log.stragglers(step, self.straggler.observe_reduced(step, obs.summary) if self.agreement.summary_way
                            else self.straggler.observe(step, list(obs)))  # (one view per run, whatever the step)
        for r in self.straggler.persisting(step):
            self.suspects.suspect(step, r, f"a straggler for {self.cfg.detectors.straggler.persist_steps}+ steps",
                                  self.emit)

    def rewound(self, step: int, to_step: int, restart: bool = False) -> None:
        """A rollback from ``step`` took the step counter back to ``to_step``: what counts steps across it starts
        again (open incidents closed; the suspects' record of shared failures kept no later than ``to_step``; the
        gradient's episode, and after a ``restart`` from the run's first step the loss and norm windows, which
        describe a later stage of training; an LR ramp fault that began is spent)."""
        self.log.close_incidents(step, why="rollback")
        self.suspects.rewound(to_step)
        self.lr_history.rewound(to_step)
        self.detectors.rewound(step, to_step, restart)
        self.faults.rolled_back()

    def lr_lowered(self) -> None:
        """The LR was lowered in place: what goes on at the lowered LR is a new episode of the gradient's trend."""
        self.detectors.tell("lr_lowered")

    def scaler_reset(self) -> None:
        """The fp16 loss scale was reset or is gone (bf16): the loss-scale watch starts again."""
        self.loss_scale.reset()

    def precision_changed(self) -> None:
        """The run goes on in another precision: a new gradient-norm distribution from here."""
        self.detectors.tell("precision_changed")

    def abort(self, step: int, decision: Decision) -> TrainguardAbort:
        """Build (and log) the report every rank raises with when the decision is ABORT."""
        return self.log.abort(step, decision, self._everyone or {}, self.skipped_steps, self.policy)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"skipped_steps": self.skipped_steps, "policy": self.policy.state_dict(),
                **self.stats.state_dict(), "lr_history": self.lr_history.state_dict(),  # (loss_spike, ...: as before)
                "clipper": self.clipper.state_dict(), "goodput": self.goodput.state_dict(),
                "detectors": self.detectors.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.skipped_steps = int(state["skipped_steps"])
        self.policy.load_state_dict(state["policy"])
        self.stats.load_state_dict(state)
        if "lr_history" in state:
            self.lr_history.load_state_dict(state["lr_history"])
        self.clipper.load_state_dict(state["clipper"])
        if "goodput" in state:
            self.goodput.load_state_dict(state["goodput"])
        self.detectors.load_state_dict(state.get("detectors", {}))


def _check_events_match() -> None:  # used by tests: one on_<event> method per Event member
    missing = [e.value for e in Event if not callable(getattr(StepGuard, f"on_{e.value}", None))]
    extra = [n for n in dir(StepGuard) if n.startswith("on_") and n[3:] not in {e.value for e in Event}]
    if missing or extra:
        raise AssertionError(f"StepGuard and Event disagree: missing {missing}, extra {extra}")

