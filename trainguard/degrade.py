"""A recovery that fails degrades, never kills: the rollback's load tried target after target, on every rank
together, and what the run does when none loads.

A rollback meets framework states no one chose for it: a first step's checkpoint written before any update was
applied (fp16's scale search skipped them: no optimizer moments in it), a checkpoint of another layout, storage that
answers with an error. The framework's own behaviour is the floor -- a run it would have finished must not end
because trainguard tried to help -- so a load that fails is recorded (``recovery_failed``, with the error) and the
next possible action is taken:

1. the next older target (a failed first step's checkpoint: the ordinary target before the onset, with the ordinary
   LR cut);
2. none loads and the weights are what they were before the first try (a load that failed before touching them,
   as most do: they fail reading or matching): the step stays skipped, the run goes on where it was, alerted --
   what the framework alone would have done;
3. none loads and the weights were touched: a clean abort at this step boundary naming every failure; nothing was set
   aside (the abandoned trajectory is moved only after a load succeeded), so the newest good checkpoint is intact.

Every rank learns whether every rank's load succeeded (one small collective, on the recovery path only).
"""
from __future__ import annotations

import dataclasses
import os

from pathlib import Path
from typing import Callable

import torch

from trainguard.errors import TrainguardAbort
from trainguard.events import Action, Record
from trainguard.isolation import all_true

MAX_TRIES = 3  # targets tried before the run goes on (or stops) without a rollback


def fingerprint(groups: list[dict]) -> list[str]:
    """A cheap digest of the parameters the optimizer updates (their sum and sum of squares, in float64): whether a
    failed load left the weights as they were. One pass over the parameters, on the recovery path only."""
    out = []
    with torch.no_grad():
        for g in groups or []:
            for p in g.get("params", []):
                if isinstance(p, torch.Tensor) and p.numel():
                    t = p.detach().double()
                    out += [float(t.sum()).hex(), float((t * t).sum()).hex()]  # (hex: NaN equals NaN)
    return out


def step_of(cp, root: Path, tag: str) -> int:
    """The step a rollback target holds (a disk tag's manifest, or a node-memory snapshot's name)."""
    from trainguard.checkpoint.snapshots import snapshot_step

    return snapshot_step(tag) if tag.startswith("memory:") else cp.disk_step(root, tag)


def load_degrading(cp, groups: list[dict], root: Path, tag: str, older: Callable[[str, int], tuple],
                   failed: Callable[[dict], None], step: int = 0) -> tuple[Path | None, str | None, bool, list[dict]]:
    """Load ``root/tag`` for the rollback decided at ``step``; on failure (on any rank) the next of ``older(tag, its step)`` -> (root, tag)
    or (root, None). ``failed``: called with each failure's record (every rank). Returns ``(root, tag, intact,
    failures)``: the target loaded (tag None: none did) and whether the weights are still those from before."""
    before = fingerprint(groups)
    failures: list[dict] = []
    for _ in range(MAX_TRIES):
        error = None
        if cp.faults is not None and cp.faults.dies_writing(step, "rollback"):
            os.kill(os.getpid(), 9)  # (the kill_rank fault, during: rollback -- a node lost mid-recovery)
        try:
            cp.load(root, tag=tag, purpose="rollback")
        except (TrainguardAbort, KeyboardInterrupt, SystemExit, GeneratorExit):
            raise  # (a decision already taken on every rank, or the process asked to stop: not a failed load)
        except BaseException as e:  # noqa: BLE001 - whatever the framework's load raised (torch's distributed
            error = f"{type(e).__name__}: {e}"[:2000]  # checkpoint raises a BaseException): the run must not die of it
        if all_true(error is None):
            return root, tag, True, failures
        import sys; _f = fingerprint(groups); print("DBG", [(i, float.fromhex(a), float.fromhex(b)) for i, (a, b) in enumerate(zip(before, _f)) if a != b], file=sys.stderr)
        failure = {"to_tag": tag, "dir": str(root), "error": error or "failed on another rank"}
        failures.append(failure)
        failed(failure)
        try:
            at = step_of(cp, root, tag)
        except Exception:  # noqa: BLE001 - (an unreadable manifest: no older target can be ordered after it)
            at = None
        if not all_true(at is not None):
            break
        root, tag = older(tag, at)
        if tag is None:
            break
    return None, None, all_true(fingerprint(groups) == before), failures


def rollback_load(cp, guard, groups: list[dict], decision, step: int, root: Path, tag: str, why: str, mode: str,
                  lr_factor: float) -> tuple:
    """The driver's rollback load (trainguard.driver): ``root/tag`` chosen for ``decision``, older targets after it
    (``mode``: recovery.rollback_to or the decision's). A first step's checkpoint that fails: the ordinary target
    before the onset, with the ordinary cut (``lr_factor``). Returns ``(decision, root, tag, why, failures)`` -- tag
    None: none loaded and the weights are untouched (the caller goes on as without a target); none loaded and the
    weights changed: a clean abort, every checkpoint kept."""
    onset = decision.onset_step or step
    tried = {"restart": decision.restart, "why": why}

    def older(failed: str, at: int) -> tuple:
        if tried["restart"]:
            tried["restart"] = False
            found = cp.rollback_target(cp.rollback_root(), onset, mode, inclusive=decision.onset_skipped)
        else:
            found = cp.rollback_target(cp.rollback_root(), min(at, onset), mode)
        tried["why"] = found[1] + " (an earlier target failed to load: recovery_failed)"
        return cp.rollback_root(), found[0]

    root, tag, intact, failures = load_degrading(cp, groups, root, tag, older, lambda f: guard.emit(
        step, Record.RECOVERY_FAILED, [], None, {"action": "rollback", **f, "reason": decision.reason}), step)
    if failures and decision.restart and not tried["restart"]:
        decision = dataclasses.replace(decision, restart=False, lr_scale=lr_factor if decision.lower_lr else None,
                                       reason=decision.reason + "; the first step's checkpoint did not load")
    if tag is None and not intact:
        raise guard.abort(step, dataclasses.replace(decision, action=Action.ABORT, reason=(
            f"{decision.reason}: no rollback target loaded and the failed load(s) changed the weights; stopped "
            "here, every checkpoint kept: " + "; ".join(f"{f['to_tag']}: {f['error']}" for f in failures))))
    why = tried["why"] if tag is not None else \
        "every rollback target failed to load (recovery_failed); the weights are untouched: training on from here"
    return decision, root, tag, why, failures
