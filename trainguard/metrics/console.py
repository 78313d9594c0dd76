"""The console: what a person watching the terminal sees of a guarded run (rank 0, on stderr, beside the framework's
own lines). A banner at start (what is on, where the log and the checkpoints go, the framework and its release), one
line per incident and per action (what, step, rank, what was done), rate-limited, and a line at the end with the run's
story in numbers. Everything it says is also in the JSONL log, in full; ``metrics.console: false`` turns it off.
"""
from __future__ import annotations

import sys
import time
from typing import Any

PREFIX = "[trainguard]"
PER_MINUTE = 30  # lines a minute at most (the banner and the end line aside); the rest are counted, and said

# the records a person should see as they happen: actions, incidents, liveness, checkpoints that could not be used
SAID = {"nonfinite", "instant_burst", "slow_rise", "grad_surge", "entropy_collapse", "entropy_saturation",
        "activation_range", "replica_mismatch", "compute_mismatch", "custom_alert", "straggler", "samples_rejected",
        "rollback", "rollback_unavailable", "recovery_failed", "loss_scale", "loss_scale_reset", "precision_fallback",
        "suspect_rank", "abort", "checkpoint_failed", "checkpoint_invalid", "resume", "resume_skipped",
        "resume_discontinuity", "hang_detected", "restart", "rank_replaced", "snapshots_off", "handover",
        "fp16_where_bf16", "no_warmup", "short_warmup", "no_clipping", "off_at_this_layout"}
# what is said whatever the rate (what was done, and liveness): the rate limit holds back alerts only
ALWAYS = {"rollback", "rollback_unavailable", "recovery_failed", "precision_fallback", "abort", "restart",
          "rank_replaced", "hang_detected", "resume", "suspect_rank"}
# what of a record's detail a line says, in this order, where present
SHOWN = ("reason", "key", "why", "to_tag", "to_step", "lr_factor", "tag", "errors", "error", "advice")


class ConsoleSink:
    """trainguard.plugins.Sink for the terminal. ``cfg``: the parsed block (the banner says what it switches on)."""

    def __init__(self, cfg, stream=None, per_minute: int = PER_MINUTE):
        self.cfg, self.stream, self.per_minute = cfg, stream, per_minute
        self.window_start, self.said, self.held = time.monotonic(), 0, 0
        self.rollbacks = 0
        self.resumed = False  # (a resume seen: the goodput's wall time runs from the run's start, across launches)

    def _write(self, text: str) -> None:
        print(f"{PREFIX} {text}", file=self.stream or sys.stderr, flush=True)

    def metric(self, step: int, values: dict[str, Any]) -> None:
        return None

    def event(self, step: int, event: str, ranks, action: str | None, detail: dict) -> None:
        detail = detail if isinstance(detail, dict) else {}
        if event == "run_start":
            return self._write(self.banner(detail))
        if event == "run_end":
            return self._write(self.ending(step, detail))
        if event == "fresh_start" and detail.get("earlier_log"):  # (an earlier run's lines moved out of this log)
            return self._write(f"a new run in {self.cfg.metrics.jsonl or 'the log'}: the earlier run's lines moved to "
                               f"{detail['earlier_log']}")
        if event not in SAID:
            return
        self.rollbacks += event == "rollback"
        self.resumed = self.resumed or event == "resume"
        now = time.monotonic()
        if now - self.window_start >= 60:
            self._release(now)
        if self.said >= self.per_minute and event not in ALWAYS:
            self.held += 1
            return
        self.said += 1
        self._write(line(step, event, ranks, action, detail))

    def _release(self, now: float) -> None:
        if self.held:
            self._write(f"... {self.held} more record(s) in the last minute: {self.cfg.metrics.jsonl or 'the log'}")
        self.window_start, self.said, self.held = now, 0, 0

    def banner(self, start: dict) -> str:
        c = self.cfg
        on = c.detectors_on()
        rel = start.get("releases")
        releases = ", ".join(f"{k} {v}" for k, v in rel.items()) if isinstance(rel, dict) else ""
        world = start.get("world")
        armed = f"; FAULTS ARMED: {len(c.faults)} injected (allow_faults)" if c.faults else ""
        probes = start.get("probes") if isinstance(start.get("probes"), dict) else {}
        if "attention_entropy" in on and probes.get("attention_modules") == []:  # (found none: said, not run silently)
            on = [d if d != "attention_entropy" else "attention_entropy (no attention-probability module matched "
                  "detectors.attention_entropy.modules: a fused attention -- HF's sdpa, flash -- has none to sample; "
                  "attn_implementation='eager' does)" for d in on]
        return (f"guarding this run -- {start.get('framework') or 'framework'}"
                + (f" ({releases})" if releases else "") + (f", {world} rank{'s' if world != 1 else ''}" if world else "")
                + f"; detectors: {', '.join(on) or 'none'}; recovery: "
                + (f"on (rollback to {c.recovery.rollback_to})" if c.recovery.enabled else "off")
                + f"; checkpoints: {c.checkpoint.saves()}; log: {c.metrics.jsonl or 'none'}{armed}"
                + " (these lines: metrics.console)")

    def ending(self, step: int, end: dict) -> str:
        g = end.get("goodput") if isinstance(end.get("goodput"), dict) else {}
        at = end.get("global_steps", end.get("iterations", step))
        parts = [f"run STOPPED at step {at} by an error ({end['interrupted']})" if end.get("interrupted") else
                 f"run ended at step {at}",
                 f"{end.get('guard_skipped_steps', 0)} step(s) skipped by trainguard",
                 f"{self.rollbacks} rollback(s)"]
        if g:
            across = ", since the run began: the time from the checkpoint it resumed from counts" if self.resumed else ""
            parts.append(f"goodput {g.get('goodput')} ({g.get('steps_lost', 0)} step(s) lost; "
                         f"{g.get('productive_s', 0):.1f} s productive of {g.get('wall_s', 0):.1f} s{across})")
        story = f"; the story: trainguard report {self.cfg.metrics.jsonl}" if self.cfg.metrics.jsonl else ""
        return ", ".join(parts) + story

    def close(self) -> None:
        if self.held:
            self._release(time.monotonic())


def line(step: int, event: str, ranks, action: str | None, detail: dict) -> str:
    """One record as one line: what, step, rank(s), what was done, and the detail a person needs first."""
    ranks = list(ranks or [])
    who = f" on rank(s) {ranks}" if 0 < len(ranks) <= 8 else f" on {len(ranks)} ranks" if ranks else ""
    head = f"step {step}: {event}" + who + (f" -> {action}" if action else "")
    said = []
    per = detail.get("per_rank") if isinstance(detail.get("per_rank"), dict) else {}
    named = [n for n in (_culprit(r, v) for r, v in per.items() if isinstance(v, dict)) if n]
    if named:  # (the culprit: where it sits, its samples, the first layer -- what a person looks at first)
        said.append("; ".join(named[:4]) + (f"; +{len(named) - 4} more rank(s)" if len(named) > 4 else ""))
    for key in SHOWN:
        value = detail.get(key)
        if value in (None, "", [], {}):
            continue
        text = str(value)
        said.append(f"{key}: {text[:320] + '...' if len(text) > 320 else text}")
    return head + (f" ({'; '.join(said)})" if said else "")


def _culprit(rank, v: dict) -> str:
    """One named rank: its (dp, tp, pp) coordinates, its samples, the first layer that produced a non-finite value."""
    c = v.get("coords") if isinstance(v.get("coords"), dict) else {}
    where = ", ".join(f"{k} {c[k]}" for k in ("dp", "tp", "pp") if k in c)
    ids = v.get("sample_ids") if isinstance(v.get("sample_ids"), (list, tuple)) else []
    parts = [f"samples {list(ids[:8])}" + ("..." if len(ids) > 8 else "")] if ids else []
    if v.get("first_nonfinite_module"):
        parts.append(f"first layer {v['first_nonfinite_module']}")
    if not parts and not where:
        return ""
    return f"rank {rank}" + (f" ({where})" if where else "") + (": " + ", ".join(parts) if parts else "")
