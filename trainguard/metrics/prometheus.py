"""Prometheus gauges and counters over HTTP from rank 0, with per-rank labels.

Metric names (alert rules in configs/prometheus/alerts.yml):

=====================================  =======  ===============================================
trainguard_step                        gauge    last optimizer step
trainguard_loss                        gauge    mean loss over ranks
trainguard_loss_median                 gauge    the spike detector's moving median
trainguard_grad_norm                   gauge    global gradient norm (raw); ``_clipped`` after clip
trainguard_local_grad_norm{rank}       gauge    each rank's local gradient norm (pre-reduction)
trainguard_local_loss{rank}            gauge    each rank's local loss
trainguard_loss_scale                  gauge    fp16 loss scale (1 otherwise)
trainguard_loss_scale_min              gauge    the scaler's floor (fp16)
trainguard_lr                          gauge    learning rate
trainguard_steps_total                 counter  optimizer steps executed (rolled-back ones included)
trainguard_skipped_steps_total         counter  steps not applied (skipped by the guard or the framework)
trainguard_events_total{event}         counter  events by type (nonfinite, instant_burst, ...)
trainguard_incident_open{record}       gauge    1 while an incident of alerts of that kind is open, else 0
trainguard_incident_alerts{record}     gauge    alerts folded into the last incident of that kind (at its close)
trainguard_attention_entropy_ratio     gauge    {layer, head, rank}: entropy / its maximum
trainguard_activation_max_abs          gauge    {module, rank}: sampled output max-abs
trainguard_heartbeat_timestamp_seconds gauge    {rank}: time of the rank's last completed step
trainguard_step_compute_seconds        gauge    {rank}: the rank's own data + forward time of the step
trainguard_straggler_ratio             gauge    {rank}: its compute time over the median rank's (windowed)
=====================================  =======  ===============================================
"""
from __future__ import annotations

import math
from typing import Any

from trainguard.errors import TrainguardError


LISTENING: set[int] = set()  # the ports this process's exporters listen on


class PrometheusSink:
    def __init__(self, port: int, addr: str = "0.0.0.0"):
        try:
            import prometheus_client as pc
        except ImportError as e:  # pragma: no cover
            raise TrainguardError("trainguard.metrics.prometheus_port needs prometheus-client: "
                                  f"pip install prometheus-client (or trainguard's [monitor] extra) ({e})") from None
        self.registry = pc.CollectorRegistry()
        g = lambda name, doc, labels=(): pc.Gauge(name, doc, labels, registry=self.registry)  # noqa: E731
        self.step = g("trainguard_step", "last optimizer step")
        self.loss = g("trainguard_loss", "mean loss over ranks")
        self.loss_median = g("trainguard_loss_median", "moving median of the loss")
        self.grad_norm = g("trainguard_grad_norm", "global gradient norm before clipping")
        self.grad_norm_clipped = g("trainguard_grad_norm_clipped", "global gradient norm after clipping")
        self.local_grad = g("trainguard_local_grad_norm", "local gradient norm before the reduction", ["rank"])
        self.local_loss = g("trainguard_local_loss", "local loss", ["rank"])
        self.loss_scale = g("trainguard_loss_scale", "fp16 dynamic loss scale")
        self.loss_scale_min = g("trainguard_loss_scale_min", "fp16 loss scale floor")
        self.lr = g("trainguard_lr", "learning rate")
        self.entropy = g("trainguard_attention_entropy_ratio", "attention entropy / maximum", ["layer", "head", "rank"])
        self.act = g("trainguard_activation_max_abs", "sampled activation max-abs", ["module", "rank"])
        self.heartbeat = g("trainguard_heartbeat_timestamp_seconds", "last completed step time", ["rank"])
        self.compute = g("trainguard_step_compute_seconds", "the rank's own data + forward time of the step", ["rank"])
        self.straggler = g("trainguard_straggler_ratio", "compute time over the median rank's, windowed", ["rank"])
        self.skipped = pc.Counter("trainguard_skipped_steps", "optimizer steps not applied", registry=self.registry)
        self.steps = pc.Counter("trainguard_steps", "optimizer steps executed", registry=self.registry)
        self.events = pc.Counter("trainguard_events", "trainguard events by type", ["event"], registry=self.registry)
        self.incident_open = g("trainguard_incident_open", "1 while an incident of that kind is open", ["record"])
        self.incident_alerts = g("trainguard_incident_alerts", "alerts in the last closed incident", ["record"])
        self.server, self.thread = pc.start_http_server(port, addr=addr, registry=self.registry)
        self.port = self.server.server_port
        LISTENING.add(self.port)  # (not a process group's: trainguard.liveness.world.World.sever leaves its scrapes alone)
        self._seen = {"executed_steps": 0, "not_applied_steps": 0}
        self._followed: set[str] = set()  # (above 64 ranks: the ranks whose straggler ratio is exported)

    def _summary(self, values: dict[str, Any]) -> None:
        """Above 64 ranks a line carries extremes, not every rank's values (docs/detection.md, "At scale"): the
        oldest clock is the heartbeat of ``rank="oldest"`` (every rank reached the step's exchange by then), the
        slowest rank's time ``rank="max"``, and the straggler ratio of each rank the detector follows (a rank it
        stops following leaves the gauge)."""
        oldest, slowest = values.get("clock_min"), values.get("compute_s_max")
        if oldest:
            self._set(self.heartbeat.labels(rank="oldest"), oldest[0])
        if slowest:
            self._set(self.compute.labels(rank="max"), slowest[0])
        followed = values.get("straggler_ratio_by_rank")
        if followed is not None or oldest:
            followed = followed or {}
            for rank in self._followed - set(followed):
                self.straggler.remove(rank)
            for rank, v in followed.items():
                self._set(self.straggler.labels(rank=rank), v)
            self._followed = set(followed)

    @staticmethod
    def _set(gauge, value) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            gauge.set(value)

    def metric(self, step: int, values: dict[str, Any]) -> None:
        self.step.set(step)
        for name in ("loss", "loss_median", "grad_norm", "grad_norm_clipped", "loss_scale", "loss_scale_min", "lr"):
            self._set(getattr(self, name), values.get(name))
        for rank, v in enumerate(values.get("local_grad_norms") or []):
            if v is not None:
                self._set(self.local_grad.labels(rank=str(rank)), v)
        for rank, v in enumerate(values.get("local_losses") or []):
            if v is not None:
                self._set(self.local_loss.labels(rank=str(rank)), v)
        # each rank's own clock at the step's exchange (it rode the per-step table)
        for rank, t in enumerate(values.get("clocks") or []):
            self._set(self.heartbeat.labels(rank=str(rank)), t)
        for key, gauge in (("compute_s", self.compute), ("straggler_ratio", self.straggler)):
            for rank, v in enumerate(values.get(key) or []):
                self._set(gauge.labels(rank=str(rank)), v)
        self._summary(values)
        # counters from the line's monotonic counts (the framework's skipped_steps goes back on a rollback)
        for key, counter in (("executed_steps", self.steps), ("not_applied_steps", self.skipped)):
            n = values.get(key)
            if isinstance(n, int) and not isinstance(n, bool) and n > self._seen[key]:
                counter.inc(n - self._seen[key])
                self._seen[key] = n
        # every rank's sampled values: a collapse on any rank reaches the alert
        for rank, layers in (values.get("attention_entropy_ratio_by_rank") or {}).items():
            for layer, ratios in layers.items():
                for head, r in enumerate(ratios):
                    self._set(self.entropy.labels(layer=layer, head=str(head), rank=str(rank)), r)
        for rank, modules in (values.get("activation_max_abs_by_rank") or {}).items():
            for module, v in modules.items():
                self._set(self.act.labels(module=module, rank=str(rank)), v)

    def event(self, step: int, event: str, ranks, action, detail) -> None:
        self.events.labels(event=event).inc()
        detail = detail or {}
        if isinstance(detail.get("incident"), dict) and detail["incident"].get("state") == "opened":
            self.incident_open.labels(record=event).set(1)
        elif event == "incident_closed" and detail.get("record"):
            self.incident_open.labels(record=detail["record"]).set(0)
            self._set(self.incident_alerts.labels(record=detail["record"]), detail.get("count"))

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
