"""Config-driven fault injection: what goes wrong in real runs, at step k on rank r.

Refused by the config unless ``allow_faults`` is true. The injector answers "does a fault fire
here?" and applies it to what it is handed; the adapter calls it at the loop points:

=====================  ===========  =====================================================
fault                  loop point   effect
=====================  ===========  =====================================================
bad_label              BATCH        one label of the first sample becomes out of range
                                    (in the loader, before the sanitiser sees it)
nan_batch, spike_batch FORWARD      floating inputs -> NaN / x factor (integer-only batch:
                                    first leaf module's output -> NaN / the loss x factor);
                                    nan_batch ``sample``: that row only (one bad sample)
nan_weights            FORWARD      NaN into one parameter on the rank (memory corruption)
bitflip                FORWARD      one bit of one parameter's first element flips on the rank (silent)
sdc_compute            FORWARD      the output of ``module`` x (1 + eps) in every forward of the rank in
                                    the window, replays included (a device computing wrong: silent)
inf_activation         FORWARD      +Inf in the output of ``module`` (a forward hook)
attention_collapse     FORWARD      one head's logits into the softmax ``module``,
                                    standardised per query, x factor
nan_loss               LOSS         the loss passed to backward becomes NaN
inf_grad               BACKWARD     +Inf in one parameter's local gradient
fp16_overflow          BACKWARD     the same, on every step of its window while the engine
                                    runs fp16 -- also when steps re-run after a rollback: it
                                    stands for a model whose values exceed fp16's range, which
                                    no loss scale fixes (bf16 does)
lr_ramp                STEP         LR x factor**(k+1) on the k-th step of the ramp, all ranks
force_action           DECIDE       the step's decision becomes ``action`` on every rank (recovery fuzzing)
kill_rank, hang_rank   FORWARD      the process SIGKILLs / SIGSTOPs itself (restart attempt
                                    ``attempt`` only: the restarted job must get past it);
                                    kill_rank ``during: snapshot`` / ``save``: in a writer
slow_rank              FORWARD      the rank sleeps ``factor`` x its previous step's time at
                                    the first forward of each step in [step, step+steps)
corrupt_checkpoint     END          bytes flipped in the largest file of the newest committed
                                    checkpoint (storage rot: the next load must notice)
checkpoint_write_error SAVE         the background write of the async save taken at ``step``
                                    fails on ``rank`` after its first file (a full disk)
=====================  ===========  =====================================================

It works without the guard too, so the demo can inject the same faults into plain DeepSpeed.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch

from trainguard.ranks.attempt import generation, restart_attempt
from trainguard.config import FaultSpec
from trainguard.faults.module_faults import _param_of, flip_bit, install_module_faults  # noqa: F401 - (flip_bit: its name here)
from trainguard.faults.poison import OutputPoison, nan_rows


def _map_floats(x: Any, fn) -> tuple[Any, bool]:
    found = False

    def go(v):
        nonlocal found
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            found = True
            return fn(v)
        if isinstance(v, dict):
            return type(v)((k, go(w)) for k, w in v.items())
        if isinstance(v, (list, tuple)):
            return type(v)(go(w) for w in v)
        return v

    return go(x), found


class FaultInjector:
    def __init__(self, faults: Sequence[FaultSpec], rank: int):
        # lr_ramp acts on the optimizer, which every rank must change alike; a forced decision is every rank's
        self.faults = [f for f in faults if f.rank == rank or f.type in ("lr_ramp", "force_action")]
        self.rank = rank
        self.fired: list[tuple[int, str]] = []  # (step, type), for the record
        self._scale_loss: dict[int, float] = {}
        self._spent: set[tuple[int, str]] = set()  # (step, type) already fired in an earlier pass
        self.precision: str = "fp32"  # the engine's, set by the adapter (fp16_overflow needs "fp16")
        self._now: set[tuple[int, str]] = set()    # fired in the current pass over the step
        self._ramp_steps: set[int] = set()         # steps an lr_ramp applied on (every rank, not only f.rank)
        self._last_start: tuple[int, float, float] | None = None  # slow_rank: (step, its start, seconds slept)
        self.quiet = False  # module faults hold still (see held())

    @contextmanager
    def held(self) -> Iterator[None]:
        """Module faults hold still meanwhile: a replay (trainguard.replay.replay) re-runs the forward, and what
        they stood for belonged to the original one."""
        self.quiet = True
        try:
            yield
        finally:
            self.quiet = False

    def _due(self, kind: str, step: int) -> list[FaultSpec]:
        # a fault fires at most once per step: after a rollback re-runs steps, the bad batch
        # (what a fault stands for) is gone, so the fault does not come back either
        return [f for f in self.faults if f.type == kind and f.active(step) and (step, kind) not in self._spent]

    def _fire(self, step: int, kind: str) -> None:
        self._now.add((step, kind))
        if (step, kind) not in self.fired:
            self.fired.append((step, kind))

    def rolled_back(self) -> None:
        """A rollback happened: an LR ramp that already began stands for a misconfigured schedule,
        which the recovery's LR reduction overrides -- it does not resume afterwards."""
        began = self._ramp_steps
        for f in self.faults:
            if f.type == "lr_ramp" and any(f.active(s) for s in began):
                self._spent |= {(s, "lr_ramp") for s in range(f.step, f.step + f.steps)}

    def step_done(self, step: int) -> None:
        """Called at the end of every step: what fired in it is spent."""
        self._spent |= {(s, k) for s, k in self.fired if s == step}
        self._now = {(s, k) for s, k in self._now if s != step}

    def fired_in(self, step: int) -> int:
        return sum(1 for s, _ in self._now if s == step)


    # BATCH -----------------------------------------------------------------------------------
    def samples(self, step: int, samples: list, label_key: str, out_of_range: int) -> list:
        """bad_label: the first label of the first sample becomes ``out_of_range``."""
        if not self._due("bad_label", step) or not samples:
            return samples
        self._fire(step, "bad_label")
        first = samples[0]
        if isinstance(first, dict) and label_key in first:
            labels = torch.as_tensor(first[label_key]).clone()
            labels.view(-1)[0] = out_of_range
            samples = [{**first, label_key: labels}, *samples[1:]]
        return samples

    # FORWARD ---------------------------------------------------------------------------------
    def process(self, step: int) -> None:
        """kill_rank / hang_rank: this process dies or stops here, like a failed or hung node."""
        import os
        import signal

        self._slow(step)
        attempt = restart_attempt()
        for kind, sig in (("kill_rank", signal.SIGKILL), ("hang_rank", signal.SIGSTOP)):
            if any(f.attempt == attempt and f.generation == generation() and f.during == "step"
                   for f in self._due(kind, step)):
                self._fire(step, kind)
                os.kill(os.getpid(), sig)

    def dies_writing(self, step: int, what: str = "snapshot") -> bool:
        """kill_rank during snapshot / save / rollback: whether this rank's writer of the snapshot of ``step`` ends the
        process after its first file (trainguard.checkpoint.memory_tier), its save once its files are written, or its
        rollback's load before the framework's (trainguard.recovery.degrade)."""
        due = [f for f in self._due("kill_rank", step) if f.during == what and f.attempt == restart_attempt()
               and f.generation == generation()]
        if not due:
            return False
        self._fire(step, "kill_rank")
        return True

    def _slow(self, step: int) -> None:
        """slow_rank: at the first forward of each step of its window, sleep ``factor`` (default 0.5) x the
        time this rank's previous step took without the sleep (a throttled device: slower by 1 + factor)."""
        import time

        now = time.perf_counter()
        last, self._last_start = self._last_start, (step, now, 0.0)
        if last is not None and last[0] == step:
            self._last_start = last  # (a later micro-batch of the same step)
            return
        due = self._due("slow_rank", step)
        if not due or last is None:
            return
        self._fire(step, "slow_rank")
        pause = due[0].factor_or_default() * max(0.0, now - last[1] - last[2])
        time.sleep(pause)
        self._last_start = (step, now, pause)

    def batch(self, step: int, inputs: Any) -> tuple[Any, OutputPoison | None]:
        """nan_batch / spike_batch on the inputs. Returns ``(inputs, poison)``: an
        :class:`OutputPoison` when an integer-only batch must be poisoned at the first module's output."""
        poison_output = None
        for f in self._due("nan_batch", step)[:1]:
            self._fire(step, "nan_batch")
            inputs, found = _map_floats(inputs, lambda t: nan_rows(t, f.sample))
            poison_output = None if found else OutputPoison(f.sample)
        for f in self._due("spike_batch", step):
            self._fire(step, "spike_batch")
            factor = f.factor_or_default()
            inputs, found = _map_floats(inputs, lambda t: t * factor)
            if not found:
                self._scale_loss[step] = factor
        return inputs, poison_output

    def install_module_faults(self, model: torch.nn.Module, step_fn) -> list:
        """Forward hooks for inf_activation, attention_collapse, sdc_compute, nan_weights and bitflip; returns their
        handles (trainguard.faults.module_faults)."""
        return install_module_faults(self, model, step_fn)

    # LOSS ------------------------------------------------------------------------------------
    def loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        if step in self._scale_loss:
            loss = loss * self._scale_loss.pop(step)
        if not self._due("nan_loss", step):
            return loss
        self._fire(step, "nan_loss")
        return loss * float("nan")  # keeps the graph; backward then yields NaN gradients too

    # BACKWARD --------------------------------------------------------------------------------
    def grad_targets(self, names: Sequence[str]) -> dict[str, list[FaultSpec]]:
        """Which parameters get an inf_grad hook (default: the first parameter)."""
        targets: dict[str, list[FaultSpec]] = {}
        for f in self.faults:
            if f.type not in ("inf_grad", "fp16_overflow"):
                continue
            targets.setdefault(_param_of(f, names), []).append(f)
        return targets

    def grad(self, step: int, spec_list: Sequence[FaultSpec], grad: torch.Tensor) -> torch.Tensor:
        kinds = {f.type for f in spec_list if f.active(step)}
        if "fp16_overflow" in kinds and self.precision == "fp16":
            self._fire(step, "fp16_overflow")  # never spent: re-run steps overflow again
        elif "inf_grad" in kinds and (step, "inf_grad") not in self._spent:
            self._fire(step, "inf_grad")
        else:
            return grad
        out = grad.clone()
        out.view(-1)[0] = float("inf")
        return out

    # END -------------------------------------------------------------------------------------
    def checkpoint_due(self, step: int) -> bool:
        if not self._due("corrupt_checkpoint", step):
            return False
        self.fired.append((step, "corrupt_checkpoint"))  # after END: spent at once, logged by the caller
        self._spent.add((step, "corrupt_checkpoint"))
        return True

    def write_error(self, step: int) -> OSError | None:
        """checkpoint_write_error: the error this rank's background write of the save at ``step`` meets."""
        if not self._due("checkpoint_write_error", step):
            return None
        self.fired.append((step, "checkpoint_write_error"))
        self._spent.add((step, "checkpoint_write_error"))
        return OSError(28, "No space left on device (injected: checkpoint_write_error)")

    # STEP ------------------------------------------------------------------------------------
    def forcing(self, step: int) -> bool:
        """Whether a force_action is due at ``step`` (its decision must be taken before the update's launch)."""
        return bool(self._due("force_action", step))

    def forced_action(self, step: int) -> str | None:
        """force_action: the decision this step is forced to (the same on every rank), None when none is."""
        for f in self._due("force_action", step):
            self._fire(step, "force_action")
            return f.action
        return None

    def lr_multiplier(self, step: int) -> float:
        mult = 1.0
        for f in self._due("lr_ramp", step):
            self._ramp_steps.add(step)  # every rank: all must stop the ramp alike after a rollback
            if f.rank == self.rank:
                self._fire(step, "lr_ramp")
            mult *= f.factor_or_default() ** (step - f.step + 1)
        return mult
