"""A recovery that fails degrades, never kills: the rollback's load tried target after target, on every rank
together, and what the run does when none loads.

A rollback meets framework states no one chose for it: a first step's checkpoint written before any update was
applied (fp16's scale search skipped them: no optimizer moments in it), a checkpoint of another layout, storage that
answers with an error. The framework's own behaviour is the floor -- a run it would have finished must not end
because trainguard tried to help -- so a load that fails is recorded (``recovery_failed``, every rank's error), the
target is not chosen again in this process, and the next possible action is taken:

1. the best target left (a failed first step's checkpoint: the ordinary target before the onset, with the ordinary
   LR cut), up to MAX_TRIES;
2. none loads and the run's state is what it was before the first try (:func:`fingerprint`): the step stays skipped,
   the run goes on where it was, alerted -- what the framework alone would have done;
3. none loads and the state was touched: a clean abort at this step boundary naming every failure; nothing was set
   aside (the abandoned trajectory is moved only after a load succeeded), so the newest good checkpoint is intact.

Every rank learns whether every rank's load succeeded (one flag all-reduced; the errors gathered only on a failure).
"""
from __future__ import annotations

import dataclasses
import os

from pathlib import Path
from typing import Callable

import torch

from trainguard.checkpoint.rollback import target_key
from trainguard.errors import TrainguardAbort
from trainguard.events import Action, Record
from trainguard.ranks.isolation import all_true, failures_of

MAX_TRIES = 3  # targets tried before the run goes on (or stops) without a rollback


def fingerprint(fw) -> list[str] | None:
    """A cheap digest of what a load writes that the run would go on from: the parameters the optimizer steps (their
    sum, min and max, each in the tensor's own dtype: no copy of them), the framework's step counter and the groups'
    LRs (a load that set the counter or the schedule back failed after it began). On the recovery path only; None when it cannot be taken
    (then a failed load is taken to have touched the weights)."""
    try:
        out = [str(fw.completed_steps())]
        with torch.no_grad():
            for g in fw.lr_groups() or []:
                out.append(repr(g.get("lr")))
                for p in g.get("params", []):
                    if isinstance(p, torch.Tensor) and p.numel():
                        lo, hi = torch.aminmax(p.detach())
                        out += [float(p.detach().sum()).hex(), float(lo).hex(), float(hi).hex()]
        return out  # (hex: NaN equals NaN)
    except Exception:  # noqa: BLE001 - (out of memory, a sharded tensor: no digest is no reason to stop)
        return None


def load_degrading(cp, fw, root: Path, tag: str, older: Callable[[], tuple], failed: Callable[[dict], None],
                   step: int = 0) -> tuple[Path | None, str | None, bool, list[dict]]:
    """Load ``root/tag`` for the rollback decided at ``step``; when it fails on any rank, the target is unloadable for
    the rest of the process (``cp.unloadable``: no later rollback chooses it) and the next, ``older()`` -> (root, tag or
    None), is tried. ``failed``: called with each failure's record (every rank; every rank's error in it). Returns
    ``(root, tag, intact, failures)``: the target loaded (tag None: none did) and whether the weights, the step counter
    and the LRs are those from before the first try."""
    before = fingerprint(fw)
    failures: list[dict] = []
    for attempt in range(MAX_TRIES):
        if cp.faults is not None and cp.faults.dies_writing(step, "rollback"):
            os.kill(os.getpid(), 9)  # (the kill_rank fault, during: rollback -- a node lost mid-recovery)
        # (a TrainguardAbort is a decision already taken on every rank, not a failed load)
        errors = failures_of(lambda: cp.load(root, tag=tag, purpose="rollback"), passthrough=(TrainguardAbort,))
        if not errors:
            return root, tag, True, failures
        failure = {"to_tag": tag, "dir": str(root), "errors": errors}
        failures.append(failure)
        failed(failure)
        cp.unloadable.add(target_key(root, tag))
        if attempt + 1 == MAX_TRIES:
            break
        root, tag = older()
        if tag is None:
            break
    after = fingerprint(fw)
    return None, None, all_true(before is not None and after == before), failures


def rollback_load(cp, guard, fw, decision, step: int, root: Path, tag: str, why: str, mode: str,
                  lr_factor: float) -> tuple:
    """The driver's rollback load (trainguard.step.driver): ``root/tag`` chosen for ``decision``, then the best target left
    (``mode``: recovery.rollback_to or the decision's) while they fail. A first step's checkpoint that fails: the
    ordinary target before the onset, with the ordinary cut (``lr_factor``). Returns ``(decision, root, tag, why,
    failures)`` -- tag None: none loaded and nothing was touched (the caller goes on as without a target); none loaded
    and something was: a clean abort naming every failure, nothing set aside (the abandoned trajectory moves only after
    a load succeeded)."""
    onset = decision.onset_step or step
    said = {"why": why}

    def older() -> tuple:
        # (not asked of trainguard.recovery.room: a failed load may have touched the state, and only a load puts it right)
        found, said["why"], _ = cp.rollback_target(cp.rollback_root(), onset, mode, inclusive=decision.onset_skipped)
        said["why"] += " (a target before it failed to load: recovery_failed)"
        return cp.rollback_root(), found

    root, tag, intact, failures = load_degrading(cp, fw, root, tag, older, lambda f: guard.emit(
        step, Record.RECOVERY_FAILED, [], None, {"action": "rollback", **f, "reason": decision.reason}), step)
    if failures and decision.restart:  # (the first step's checkpoint is the one a restart tries first)
        decision = decision.as_ordinary(lr_factor, "; the first step's checkpoint did not load")
    if tag is None and not intact:
        named = "; ".join(f"{f['to_tag']}: " + ", ".join(f"rank(s) {g['ranks']}: {g['error']}" for g in f["errors"])
                          for f in failures)
        raise guard.abort(step, dataclasses.replace(decision, action=Action.ABORT, reason=(
            f"{decision.reason}: no rollback target loaded and a failed load changed the run's state; stopped here, "
            f"no checkpoint set aside: {named}")))
    why = said["why"] if tag is not None else \
        "every rollback target failed to load (recovery_failed); nothing was changed: training on from here"
    return decision, root, tag, why, failures
