"""Forwards again through a plain torch module, on the current weights, for the guard (trainguard.replay.replay,
trainguard.detectors.peer_replay): the localisation of a non-finite step's first bad module, the data-or-weights
replay of a recorded micro-batch or one of its rows, and a micro-batch replayed for a data-parallel peer. No
gradients; the run's random numbers are put back afterwards; injected module faults hold still (they stood for the
original forward), the micro-batch's own poison comes with it.

For an adapter whose model is called as ``module(*inputs, **kwargs)`` and records each training micro-batch as
``(inputs, kwargs, poison)`` (DeepSpeed's engine.module, ds_plugins/engine.py; a framework of plain torch calls):
its ``localize``, ``replay`` and ``peer_replay`` are what the session is built with. (A framework whose forward
runs through its own schedule replays there: megatron_hooks/replay.py.)"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch

from trainguard.replay.outputs import finite_proxy, output_value, row_of, scalar_loss, set_rng_state
from trainguard.faults.poison import PoisonFirstLeaf
from trainguard.replay.probes import FiniteWatch, first_nonfinite, preserved_rng


class ModuleReplays:
    """The replays of one rank's model: ``module()`` returns it as it is now (a framework may rebuild it in place);
    the session (:meth:`bind`) holds the recorded micro-batches and the fault injector."""

    def __init__(self, module: Callable[[], torch.nn.Module], rank: int):
        self.module, self.rank = module, rank
        self.session = None
        self._watch_trusted = True  # module outputs all finite on the last healthy replay (see replay)

    def bind(self, session) -> None:
        """The session whose replay book (the step's micro-batches, the last healthy one) and faults are read."""
        self.session = session

    def localize(self) -> dict:
        """Replay this rank's last micro-batch with a hook on every module (no gradients, RNG
        untouched); every rank does it together, since a ZeRO-3 forward gathers parameters."""
        if not self.session.replays.book.step:
            return {"module": None, "note": "no micro-batch to replay"}
        inputs, kwargs, poison_output = self.session.replays.book.step[-1].inputs
        model = self.module()
        # the poison hook (nan_batch on an integer-only batch) must be registered before the
        # localisation hooks, so that they see the output it replaced
        with self.replaying(poison_output):
            report = first_nonfinite(model, lambda: model(*inputs, **kwargs))
        report["rank"] = self.rank
        return report

    @contextlib.contextmanager
    def replaying(self, poison):
        """Around a replayed forward: the RNG put back afterwards, and the micro-batch's own poison."""
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with preserved_rng(devices), PoisonFirstLeaf(self.module(), poison) if poison else \
                contextlib.nullcontext():
            yield

    def replay(self, mb, row):
        """trainguard.replay.replay: the loss of a recorded micro-batch (``row`` None) or of one of its rows,
        on the current weights: no gradients, RNG untouched, injected module faults held still (they
        stood for the original forward). None when the model's output holds no scalar loss."""
        inputs, kwargs, poison = mb.inputs
        if row is not None:
            (inputs, kwargs) = row_of((inputs, kwargs), row, mb.rows)
            poison = poison.for_row(row) if poison else None
        held = self.session.faults.held() if self.session.faults is not None else contextlib.nullcontext()
        watch = FiniteWatch(self.module())
        with held, self.replaying(poison), torch.no_grad(), watch.watching():
            out = self.module()(*inputs, **kwargs)
        loss = scalar_loss(out)
        if loss is None:
            loss = finite_proxy(out)
        if row is None and mb is self.session.replays.book.healthy:
            # the weights' probe: its loss alone decides; whether this model's intermediates are all finite on
            # healthy data (a module may output a -inf mask) says whether the rows' replays may use the watch
            self._watch_trusted = watch.finite()
            return loss
        # a non-finite activation inside the forward makes the gradients non-finite, whatever the loss says
        return loss if loss is None or watch.finite() or not self._watch_trusted else float("nan")

    def peer_replay(self, payload, seed: int):
        """detectors.peer_replay: a micro-batch (a peer's, or this rank's own) forward-only on the current weights
        in train mode, from the random-number state its owner's training forward started from (dropout draws the
        same masks; without one, seeded alike on every replica), the run's own put back afterwards. Returns (its loss
        or None, the digest of the output's floating tensors or None)."""
        (inputs, kwargs, poison), rng = payload
        held = self.session.faults.held() if self.session.faults is not None else contextlib.nullcontext()
        with held, self.replaying(poison), torch.no_grad():
            if rng is not None:
                set_rng_state(rng)
            else:
                torch.manual_seed(seed)
            out = self.module()(*inputs, **kwargs)
        return tuple(None if v is None else float(v) for v in output_value(out))
