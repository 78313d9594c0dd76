"""The per-step state machine: the loop points of :class:`trainguard.events.Event`, in order.

Framework-free: an adapter (``ds_plugins``, ``megatron_hooks``) calls ``on_<event>`` at the right
moments of its framework's loop and carries out the action it gets back from ``on_decide``. The
guard never imports a framework and never touches an optimizer.

Cost on a healthy step: a few device-side ops per micro-batch (loss flag) and per parameter
gradient (a norm added into one scalar), one all-reduce of ``world x 6`` float64 values, and one
host synchronisation to read it. Sample ids travel in a second collective only on anomaly steps.
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any, Sequence

import torch

from trainguard import __version__
from trainguard.config import TrainguardConfig
from trainguard.data import DataPosition
from trainguard.detectors import RankObservation, detect_nonfinite
from trainguard.errors import TrainguardAbort
from trainguard.events import Action, Event, Record
from trainguard.faults import FaultInjector
from trainguard.isolation import FIELDS, F, RankCoords, agree, gather_objects, observations
from trainguard.metrics.jsonl import JsonlSink
from trainguard.policy import Decision, Policy


def config_hash(cfg: TrainguardConfig) -> str:
    text = json.dumps(cfg.model_dump(mode="json"), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def per_rank_path(path: str, rank: int) -> str:
    p = Path(path)
    return str(p.with_name(f"{p.stem}.rank{rank}{p.suffix or '.jsonl'}"))


class StepGuard:
    """One per rank. ``group`` is the process group the AGREE collective runs on (None: world)."""

    def __init__(self, cfg: TrainguardConfig, rank: int, world: int, group=None,
                 device: torch.device | str = "cpu"):
        self.cfg = cfg
        self.device = torch.device(device)
        self.rank, self.world, self.group = rank, world, group
        self.policy = Policy(cfg.detectors.nonfinite)
        self.faults = FaultInjector(cfg.faults, rank)
        self.coords: list[RankCoords] = []
        self.log: JsonlSink | None = None
        self.rank_log: JsonlSink | None = None
        self.skipped_steps = 0      # steps the guard skipped (DeepSpeed's own count is separate)
        self.last_decision: Decision | None = None
        self.last_step = 0
        self._reset_step()

    # ------------------------------------------------------------------ helpers
    def _reset_step(self) -> None:
        self._acc: torch.Tensor | None = None       # [loss_sum, loss_nonfinite, grad_sq] on device
        self._micro = 0
        self._grad_hooks = 0
        self._sample_ids: list[int] = []
        self._position: DataPosition | None = None

    def _ensure_acc(self) -> torch.Tensor:
        # On the device the collective backend reduces (the adapter says which): gloo -> CPU,
        # NCCL -> the rank's GPU, where the loss and gradients already are.
        if self._acc is None:
            self._acc = torch.zeros(3, dtype=torch.float64, device=self.device)
        return self._acc

    @property
    def checking(self) -> bool:
        return self.cfg.detectors.nonfinite.enabled

    # ------------------------------------------------------------------ loop points
    def on_begin(self, coords: Sequence[RankCoords], framework: dict[str, Any]) -> None:
        """BEGIN: coordinates of every rank are known; open the logs; record the run's identity."""
        self.coords = list(coords)
        m = self.cfg.metrics
        if m.jsonl:
            if self.rank == 0:
                self.log = JsonlSink(m.jsonl)
            if m.per_rank:
                self.rank_log = JsonlSink(per_rank_path(m.jsonl, self.rank))
        if self.log:
            self.log.event(0, Record.RUN_START.value, range(self.world), None, {
                "trainguard": __version__, "config_hash": config_hash(self.cfg),
                "world": self.world, "coords": [c.as_dict() for c in self.coords],
                "faults": [f.model_dump() for f in self.cfg.faults], **framework})

    def on_batch(self, sample_ids: list[int], position: DataPosition) -> None:
        """BATCH: the loader handed out a micro-batch with these dataset indices."""
        self._sample_ids.extend(sample_ids)
        self._position = position

    def on_forward(self, step: int, inputs: Any) -> tuple[Any, bool]:
        """FORWARD: faults may poison the inputs. Returns ``(inputs, poison_first_module_output)``."""
        return self.faults.batch(step, inputs)

    def on_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """LOSS: the loss handed to backward. Device-side flags only: no host sync here."""
        loss = self.faults.loss(step, loss)
        self._micro += 1
        if self.checking and isinstance(loss, torch.Tensor):
            acc = self._ensure_acc()
            value = loss.detach().to(self.device, torch.float64).sum()
            acc[0].add_(value)
            acc[1].add_((~torch.isfinite(value)).to(torch.float64))
        return loss

    def on_backward(self, grad: torch.Tensor) -> None:
        """BACKWARD: a tensor hook per parameter, fired with the *local* gradient before any
        data-parallel reduction. Adds its squared norm into one device scalar (NaN/Inf propagate)."""
        if grad is None:
            return
        acc = self._ensure_acc()
        n = torch.linalg.vector_norm(grad.detach(), dtype=torch.float32).to(self.device)
        acc[2:3].addcmul_(n.view(1), n.view(1))
        self._grad_hooks += 1

    def on_agree(self, step: int, loss_scale: float = 1.0, grad_divisor: float = 1.0) -> list[RankObservation]:
        """AGREE: the one collective. Every rank calls it at every optimizer step."""
        row = torch.zeros(len(FIELDS), dtype=torch.float64, device=self.device)
        if self._acc is not None:
            row[F["loss_sum"]] = self._acc[0]
            row[F["loss_nonfinite"]] = self._acc[1]
            row[F["grad_sq"]] = self._acc[2]
        row[F["micro_batches"]] = self._micro
        row[F["grad_checked"]] = self._grad_hooks
        row[F["faults_fired"]] = self.faults.fired_in(step)
        table = agree(row, self.group)
        return observations(table, loss_scale=loss_scale, grad_divisor=grad_divisor)

    def on_decide(self, step: int, obs: list[RankObservation]) -> Decision:
        """DECIDE: pure detectors -> policy -> one action, identical on every rank."""
        verdicts = []
        if self.checking:
            v = detect_nonfinite(obs)
            if v is not None:
                verdicts.append(v)
        decision = self.policy.decide(verdicts)
        self.last_decision = decision
        self._log_faults(step, obs)
        if decision.action is not Action.CONTINUE:
            self._log_anomaly(step, decision)
        return decision

    def on_step(self, step: int, decision: Decision, applied: bool) -> None:
        """STEP: the adapter applied or skipped the optimizer step; check it did what was decided."""
        if decision.action is Action.SKIP_STEP:
            if applied:
                raise RuntimeError(f"rank {self.rank}: step {step} was decided SKIP_STEP but the framework "
                                   "applied it; this optimizer is not supported by the skip path")
            self.skipped_steps += 1
        elif decision.action is Action.CONTINUE and not applied and self.log:
            self.log.event(step, Record.FRAMEWORK_SKIP.value, [], None,
                           {"reason": "the framework skipped this step itself (e.g. fp16 loss-scale overflow "
                                      "found after the reduction)"})

    def on_end(self, step: int, obs: list[RankObservation], metrics: dict[str, Any]) -> None:
        """END: the metric line(s); reset the per-step accumulators."""
        self.last_step = step
        if step % self.cfg.metrics.every_steps == 0 or (self.last_decision and
                                                         self.last_decision.action is not Action.CONTINUE):
            finite = [o.loss for o in obs if o.micro_batches and math.isfinite(o.loss)]
            loss = (sum(finite) / len(finite)) if len(finite) == len(obs) and finite else float("nan")
            line = {"loss": loss, **metrics, "guard_skipped_steps": self.skipped_steps}
            if self.log:
                self.log.metric(step, **line)
            if self.rank_log:
                me = obs[self.rank]
                self.rank_log.metric(step, rank=self.rank, local_loss=me.loss, local_grad_norm=me.grad_norm,
                                     sample_ids=self._sample_ids,
                                     position=self._position.as_dict() if self._position else None, **line)
        self._reset_step()

    def on_close(self, totals: dict[str, Any] | None = None) -> None:
        """CLOSE: totals, then close the files."""
        if self.log:
            self.log.event(self.last_step, Record.RUN_END.value, range(self.world), None,
                           {"guard_skipped_steps": self.skipped_steps,
                            "nonfinite_steps": self.policy.total_nonfinite, **(totals or {})})
        for sink in (self.log, self.rank_log):
            if sink:
                sink.close()
        self.log = self.rank_log = None

    # ------------------------------------------------------------------ records
    def _log_faults(self, step: int, obs: list[RankObservation]) -> None:
        fired_ranks = [o.rank for o in obs if o.faults_fired]
        if not fired_ranks:
            return
        specs = [f.model_dump() for f in self.cfg.faults if f.step == step and f.rank in fired_ranks]
        for sink in (self.log, self.rank_log if self.rank in fired_ranks else None):
            if sink:
                sink.event(step, Record.FAULT_INJECTED.value, fired_ranks, None, {"faults": specs})

    def _log_anomaly(self, step: int, decision: Decision) -> None:
        """Anomaly steps only (all ranks take this branch together): gather sample ids and data
        positions, then name the culprits with their coordinates, host and samples."""
        mine = {"sample_ids": self._sample_ids,
                "position": self._position.as_dict() if self._position else None}
        everyone = gather_objects(mine, self.group)
        for v in decision.verdicts:
            detail = dict(v.detail)
            per_rank = {}
            for r, d in v.detail.get("per_rank", {}).items():
                c = self.coords[r].as_dict() if r < len(self.coords) else {"rank": r}
                per_rank[str(r)] = {**d, "coords": c, **everyone[r]}
            if per_rank:
                detail["per_rank"] = per_rank
            detail["reason"] = decision.reason
            if v.ranks and self._sample_ids == [] and all(not e["sample_ids"] for e in everyone):
                detail["sample_ids_note"] = ("unknown: pass training_data to ds_plugins.initialize so "
                                             "the loader can report sample ids")
            for sink in (self.log, self.rank_log if self.rank in v.ranks else None):
                if sink:
                    sink.event(step, v.anomaly, v.ranks, decision.action.value, detail,
                               skipped_steps=self.skipped_steps + (decision.action is Action.SKIP_STEP))
        self._last_everyone = everyone

    def abort(self, step: int, decision: Decision) -> TrainguardAbort:
        """Build (and log) the report every rank raises with when the decision is ABORT."""
        report = {"step": step, "reason": decision.reason,
                  "verdicts": [{"detector": v.detector, "anomaly": v.anomaly, "ranks": list(v.ranks),
                                "detail": v.detail} for v in decision.verdicts],
                  "coords": {str(r): self.coords[r].as_dict() for v in decision.verdicts for r in v.ranks
                             if r < len(self.coords)},
                  "samples": {str(r): getattr(self, "_last_everyone", [{}] * self.world)[r]
                              for v in decision.verdicts for r in v.ranks},
                  "tried": {"skipped_steps": self.skipped_steps, **self.policy.state_dict()}}
        if self.log:
            self.log.event(step, Record.ABORT.value, sorted({r for v in decision.verdicts for r in v.ranks}),
                           Action.ABORT.value, report)
        return TrainguardAbort(f"trainguard aborted the run at step {step}: {decision.reason}", report)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"skipped_steps": self.skipped_steps, "policy": self.policy.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.skipped_steps = int(state["skipped_steps"])
        self.policy.load_state_dict(state["policy"])


def _check_events_match() -> None:  # used by tests: one on_<event> method per Event member
    missing = [e.value for e in Event if not callable(getattr(StepGuard, f"on_{e.value}", None))]
    extra = [n for n in dir(StepGuard) if n.startswith("on_") and n[3:] not in {e.value for e in Event}]
    if missing or extra:
        raise AssertionError(f"StepGuard and Event disagree: missing {missing}, extra {extra}")
