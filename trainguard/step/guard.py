"""The per-step state machine: the loop points of :class:`trainguard.events.Event`, in order.

Framework-free: an adapter (``ds_plugins``, ``megatron_hooks``) calls ``on_<event>`` at the right
moments of its framework's loop and carries out the action it gets back from ``on_decide``. The
guard never imports a framework and never touches an optimizer.

Cost on a healthy, unsampled step: a handful of device-side ops (the loss flags, the local gradients' norms at the
framework's reduction points), the step's agreement (trainguard.step.agreement) and one host read of it -- at the
update's launch where the adapter can (trainguard.step.launchgate). The framework's global gradient norm of a step
rides in the *next* step's table, which is why a metric line is written one step late. Sampled, anomaly and
set-aside steps add one object gather (sample ids, probe statistics, localisation; above 64 ranks the named ranks').
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from trainguard.prevent.checks import RunFacts, start_checks
from trainguard.prevent.clipping import Clipper
from trainguard.config import TrainguardConfig
from trainguard.data.position import DataPosition
from trainguard.verdicts import ScalerState
from trainguard.detectors.loss_spike import LR_LOOKBACK
from trainguard.recovery.lrcut import LrHistory
from trainguard.detectors.lineup import Lineup
from trainguard.detectors.registry import Decide
from trainguard.ranks.attribution import by_rank
from trainguard.errors import TrainguardAbort
from trainguard.events import Action, Record
from trainguard.step.evidence import Evidence
from trainguard.faults.injector import FaultInjector
from trainguard.observe.goodput import GoodputMeter, clean_end
from trainguard.step.agreement import Agreement, StepView
from trainguard.ranks.isolation import RankCoords
from trainguard.step.judgement import Judgement
from trainguard.step.metricline import DeferredLine, step_line
from trainguard.recovery.policy import Decision, Policy, anomaly_class
from trainguard.replay.probes import SampledProbes
from trainguard.replay.replay import MicroBatch
from trainguard.replay.replays import Replays
from trainguard.observe.steplog import StepLog
from trainguard.step.steptime import StepTimer
from trainguard.step.tally import LocalGrads, StepTally
from trainguard.recovery.suspects import SuspectWatch


class StepGuard:
    """One per rank. ``group`` is the process group the AGREE collective runs on (None: world). ``localize``:
    trainguard.step.evidence.Evidence's; ``replay``, ``narrow_rows``, ``replay_peers`` (default: this rank alone),
    ``peer_replay``: trainguard.replay.replays.Replays' (from an adapter that can replay); ``hints``: the adapter's advice
    in records (its capabilities' ``HINTS``)."""

    def __init__(self, cfg: TrainguardConfig, rank: int, world: int, group=None,
                 device: torch.device | str = "cpu", localize: Callable[[], dict] | None = None,
                 replay: Callable[[MicroBatch, int | None], float | None] | None = None, narrow_rows: bool = False,
                 replay_peers: Sequence[int] | None = None, peer_replay: Callable[[Any, int], tuple] | None = None,
                 collective=None, policy: Policy | None = None, goodput: GoodputMeter | None = None,
                 faults: FaultInjector | None = None, clipper: Clipper | None = None, hints: dict | None = None,
                 lr_history: LrHistory | None = None):
        self.cfg = cfg
        self.device = torch.device(device)
        self.rank, self.world, self.group = rank, world, group
        # (the parts others act on too -- the policy's ladders and LR cooldown, the goodput meter, the fault
        # injector -- are the session's, handed to each that needs them: trainguard.step.session)
        self.policy = policy if policy is not None else Policy(cfg.detectors.nonfinite, cfg.recovery)
        self.faults = faults if faults is not None else FaultInjector(cfg.faults, rank)
        self.lr_now: float | None = None  # this rank's LR of the coming update (the driver sets it before AGREE)
        # the LR each recent step used (rank 0's): the LR cut's evidence (the session's: its checkpoints read it too)
        self.lr_history = lr_history if lr_history is not None else LrHistory.for_trend(cfg.detectors.loss_trend)
        self.goodput = goodput if goodput is not None else GoodputMeter()
        self._scaled = False  # an fp16 loss scale is on (set at AGREE)
        self.clipper = clipper if clipper is not None else Clipper(cfg.clipping)
        self.detectors = Lineup(cfg, self.device)  # the registered ones and yours (trainguard.detectors.lineup)
        self.stats = self.detectors.stats  # (the statistics' windows: a healthy loss, the loss median, a rise's onset)
        exchanging = self.detectors.exchanging
        self.replays = Replays(replay if cfg.recovery.replay_check else None, peer_replay if exchanging else None,
                               narrow_rows and replay is not None and cfg.recovery.narrow_samples,
                               set(replay_peers) if replay_peers is not None else {rank}, self.stats.healthy_loss,
                               cfg.recovery.enabled, take_ids=lambda: self.tally.take_ids(),
                               sampled=self.detectors.sampled)
        self.probes = SampledProbes(cfg.detectors)  # activation range, attention entropy: on their sampled steps
        self.coords: list[RankCoords] = []
        self.log = StepLog(rank, cfg, self.coords_of, (hints or {}).get("sample_ids"))  # (trainguard.observe.steplog)
        self.events = self.log.events
        self.last_step = 0
        self.last_metrics: dict = {}            # the last metric line (a checkpoint's health)
        self.suspects = SuspectWatch(cfg.recovery.suspect_after, rank, cfg.metrics.jsonl, self.coords_of, world)
        self.judgement = Judgement(cfg, self.policy, self.stats, self.lr_history, self.replays, self.suspects,
                                   self.log)  # DECIDE's second half, STEP's check: the decision, the blame, the scale
        self._probe_values: dict = {}
        self.deferred = DeferredLine(self.events, self.clipper)  # the previous step's line, awaiting its norm
        self.timer = StepTimer(self.device)  # this rank's own time per step (the straggler detector's input)
        # the step's collectives (trainguard.step.agreement: every rank's rows up to 64 ranks, a fixed-size summary above)
        self.agreement = Agreement(rank, world, self.device, group, collective, extra=self.detectors.columns)
        self.evidence = Evidence(cfg, rank, self.device, group, self.detectors, self.probes, self.replays,
                                 self.agreement, localize)  # (DECIDE's first half: trainguard.step.evidence)
        self.grads = LocalGrads()  # the local gradients' norms; ``grad_checks``: what the hooks call, no call between
        self.grad_checks = (self.grads.add, self.grads.add_all)  # (a tensor hook's; a reduction point's)
        self.tally = StepTally(self.device, self.grads)  # this step's accumulators (trainguard.step.tally), anew each step

    # ------------------------------------------------------------------ helpers
    def attach_model(self, model: torch.nn.Module) -> None:
        """The modules the sampled probes watch (hooked on sampled steps only); the model to the detectors."""
        self.detectors.attach_model(model)
        self.probes.attach(model)

    def probing(self, step: int):
        """Around the model's forward: opens the probes on sampled steps, else does nothing."""
        return self.probes.probing(step)

    def coords_of(self, rank: int) -> dict:
        return self.coords[rank].as_dict() if rank < len(self.coords) else {"rank": rank}

    def mirror(self, make: Callable[[list], Any]) -> None:
        """Another sink for the records: ``make(every rank's coordinates)`` (trainguard.step.session.GuardSession.mirror)."""
        self.events.mirrors.append(make(self.coords))

    def emit(self, step: int, record: Record, ranks=(), action: str | None = None, detail: dict | None = None,
             rank_local: bool = False, **extra) -> None:
        """Write one record (trainguard.observe.eventlog.EventLog.emit): the one way anything is logged."""
        self.log.emit(step, record, ranks, action, detail, rank_local=rank_local, **extra)

    # ------------------------------------------------------------------ loop points
    def on_begin(self, coords: Sequence[RankCoords], framework: dict[str, Any], facts: RunFacts | None = None) -> None:
        """BEGIN: every rank's coordinates known; the logs opened, the run's identity recorded, the start checks run."""
        self.coords = list(coords)
        self.suspects.begin(self.coords)
        self.events.open(self.cfg)
        if self.rank == 0:
            self.log.run_start(self.world, self.coords, framework, self.probes, self.agreement,
                               self.detectors.rows_every_step)
        if facts is not None:
            self.lr_history.last_step = facts.last_step  # (a restart's room: trainguard.recovery.lrcut)
            for v in start_checks(facts, self.cfg, replicas=len({c.dp for c in self.coords}) or None):
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
        self.tally.loss(loss, self.cfg.detectors.nonfinite.enabled)
        return loss

    def on_backward(self, grad: torch.Tensor) -> None:
        """BACKWARD: one *local* gradient, before any data-parallel reduction (a tensor hook's; where the framework
        reduces buckets, trainguard.step.gradhooks calls ``grads.add_all`` instead). Its norm, NaN/Inf propagating."""
        self.grads.add(grad)  # (one norm kernel per gradient; combined once, at AGREE)

    def on_agree(self, step: int, loss_scale: float = 1.0, grad_divisor: float = 1.0,
                 dynamic_scale: bool = False, late: bool = False) -> StepView | Callable[[], StepView]:
        """AGREE: the step's collectives (trainguard.step.agreement), every rank, every optimizer step. ``dynamic_scale``:
        fp16's dynamic loss scaler is on. ``late``: launched; the call returned reads them (trainguard.step.launchgate)."""
        row = self.tally.row(self.agreement, self.faults.fired_in(step), self.timer.take(), self.lr_now, self.deferred)
        self.detectors.local(step, row)
        read = self.agreement.launch(row, loss_scale, grad_divisor, want_rows=self.detectors.wants_rows(step))
        self._scaled = dynamic_scale
        return read if late else self.agreed(read())

    def agreed(self, view: StepView) -> StepView:  # (the previous step's line written, with the norms ``view`` brought)
        return self.deferred.flushed(view)

    def clear(self, step: int, view: StepView) -> bool:
        """Whether ``view``'s step may be applied before DECIDE: trainguard.step.evidence.Evidence.clear."""
        return self.evidence.clear(step, view)

    def on_decide(self, step: int, obs: StepView) -> Decision:
        """DECIDE: pure detectors -> policy -> one action, identical on every rank. The registered detectors
        (trainguard.detectors.registry) read the step's summary (trainguard.ranks.reduced), the rows where they travelled,
        and -- after the one object gather of an anomaly or sampled step -- the named ranks' objects."""
        s = obs.summary
        ctx = Decide(obs, self.coords, scaled=self._scaled, lr=self.lr_history.agree(s.lr),
                     lr_ratio=lambda: self.lr_history.ratio(step, LR_LOOKBACK))
        everyone = self.evidence.gather(step, ctx, self.tally, lambda at, r, why: self.suspects.suspect(
            at, r, why, self.emit))
        # every rank's sampled values (they came with the gather above: no extra synchronisation)
        self._probe_values = {k: by_rank(everyone, k) if ctx.probed[k] is not None else None
                              for k in ("activation", "entropy")}
        custom = self.detectors.custom_verdicts(step, s, ctx.rows)  # (yours, before anything is decided: alerts only)
        decision = self.judgement.decide(step, ctx, everyone, self._scaled, self.agreement.summary_way)
        self.log.custom_alerts(step, custom)
        return decision

    @property
    def culprit_samples(self) -> dict[int, list[int]]:
        """{rank: the samples it is to blame for} of the last step (the driver sets them aside)."""
        return self.judgement.culprit_samples

    @property
    def skipped_steps(self) -> int:
        """Steps the guard skipped (the framework's own count is separate)."""
        return self.judgement.skipped_steps

    @property
    def weights(self) -> str | None:
        """This step's weights check: "healthy" (the data was to blame), "damaged", or None (none made)."""
        return self.replays.weights

    def on_step(self, step: int, decision: Decision, applied: bool,
                scaler: ScalerState | None = None) -> Decision | None:
        """STEP: the adapter applied or skipped the optimizer step, checked against the decision. ``scaler`` (fp16
        with a dynamic loss scale): as it was when the step began; a collapse returns the ``loss_scale`` ladder's
        decision, which the adapter carries out now; otherwise None (trainguard.step.judgement)."""
        return self.judgement.stepped(step, decision, applied, scaler)

    def on_end(self, step: int, obs: StepView, metrics: dict[str, Any]) -> None:
        """END: this step's line(s), written when its global norm comes with the next table (may be a device tensor)."""
        self.last_step = step
        pending = {k: metrics.pop(k, None) for k in ("grad_norm", "clip_limit", "applied_grad_sq")}
        line = step_line(obs, metrics, self.stats.loss_median(), self.skipped_steps, self.judgement.straggler.last,
                         self._probe_values)
        rank_line = self.tally.rank_line(self.rank, obs.own) if self.events.rank_log is not None else None
        self.faults.step_done(step)
        d = self.judgement.last
        self.replays.book.step_ended(bool(metrics.get("applied", True)) and d is not None and d.action is Action.CONTINUE
                             and not any(anomaly_class(v) for v in d.verdicts))
        self.last_metrics = line
        self.deferred.hold(step, line, rank_line, self.line_due(step), metrics.get("applied", True), **pending)
        self._probe_values = {}
        self.log.close_incidents(step)
        self.tally = StepTally(self.device, self.grads)
        self.timer.start()  # (the next step's own time counts from here)

    def line_due(self, step: int) -> bool:
        """Whether this step's metric line is written (known once DECIDE has run)."""
        return step % self.cfg.metrics.every_steps == 0 or (
            self.judgement.last is not None and self.judgement.last.action is not Action.CONTINUE)

    def on_close(self, totals: dict[str, Any] | None = None) -> None:  # CLOSE: the last metric line, the totals
        self.deferred.close(self.world)
        self.log.run_end(self.last_step, self.world, {"guard_skipped_steps": self.skipped_steps,
                                                      "nonfinite_steps": self.policy.total_nonfinite,
                                                      "checks_run": self.detectors.checks_run(), **(totals or {})})

    # ------------------------------------------------------------------ records
    def forward_done(self) -> None:
        """The adapter's forward returned (each micro-batch; the last one of the step counts)."""
        self.timer.mark()

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
        self.judgement.loss_scale.reset()

    def precision_changed(self) -> None:
        """The run goes on in another precision: a new gradient-norm distribution from here."""
        self.detectors.tell("precision_changed")

    def new_run(self) -> str | None:  # (a fresh start in its first attempt: an earlier run's log lines set aside)
        return self.events.new_run()

    def abort(self, step: int, decision: Decision) -> TrainguardAbort:
        """Build (and log) the report every rank raises with when the decision is ABORT."""
        return self.log.abort(step, decision, self.judgement.everyone or {}, self.skipped_steps, self.policy)

    def health(self) -> dict:
        """A checkpoint's manifest's ``health``: the last line's loss, loss median, loss scale; the recent verdicts."""
        last = self.last_metrics
        return {"loss": last.get("loss"), "loss_median": last.get("loss_median"), "loss_scale": last.get("loss_scale"),
                "recent_anomalies": self.judgement.recent_anomalies[-10:]}

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {**self.judgement.state_dict(), **self.stats.state_dict(), "lr_history": self.lr_history.state_dict(),  # (loss_spike, ...: as before)
                "clipper": self.clipper.state_dict(), "goodput": self.goodput.state_dict(),
                "detectors": self.detectors.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.judgement.load_state_dict(state)
        self.stats.load_state_dict(state)
        if "lr_history" in state:
            self.lr_history.load_state_dict(state["lr_history"])
        self.clipper.load_state_dict(state["clipper"])
        if "goodput" in state:  # (a finished launch's idle time before this one is no downtime: goodput.clean_end)
            self.goodput.load_state_dict(state["goodput"], ended=clean_end(self.cfg.metrics.jsonl))
        self.detectors.load_state_dict(state.get("detectors", {}))

