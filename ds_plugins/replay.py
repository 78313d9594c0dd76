"""Forwards again, on the current weights, for the guard (trainguard.replay, trainguard.detectors.peer_replay):
the localisation of a non-finite step's first bad module, the data-or-weights replay of a recorded micro-batch or
one of its rows, and a micro-batch replayed for a data-parallel peer. No gradients; the run's random numbers are
put back afterwards; injected module faults hold still (they stood for the original forward), the micro-batch's
own poison comes with it."""
from __future__ import annotations

import contextlib

import torch

from trainguard.ports import FiniteWatch, first_nonfinite, PoisonFirstLeaf, preserved_rng


class Replays:
    """The replays of one guarded engine (``ag``: its ds_plugins.engine.EngineGuard)."""

    def __init__(self, ag):
        self.ag = ag
        self._watch_trusted = True  # module outputs all finite on the last healthy replay (see replay)

    def localize(self) -> dict:
        """Replay this rank's last micro-batch with a hook on every module (no gradients, RNG
        untouched); every rank does it together, since a ZeRO-3 forward gathers parameters."""
        if not self.ag.guard.book.step:
            return {"module": None, "note": "no micro-batch to replay"}
        inputs, kwargs, poison_output = self.ag.guard.book.step[-1].inputs
        model = self.ag.engine.module
        # the poison hook (nan_batch on an integer-only batch) must be registered before the
        # localisation hooks, so that they see the output it replaced
        with self.replaying(poison_output):
            report = first_nonfinite(model, lambda: model(*inputs, **kwargs))
        report["rank"] = self.ag.rank
        return report

    @contextlib.contextmanager
    def replaying(self, poison):
        """Around a replayed forward: the RNG put back afterwards, and the micro-batch's own poison."""
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with preserved_rng(devices), PoisonFirstLeaf(self.ag.engine.module, poison) if poison else \
                contextlib.nullcontext():
            yield

    def replay(self, mb, row):
        """trainguard.replay: the loss of a recorded micro-batch (``row`` None) or of one of its rows,
        on the current weights: no gradients, RNG untouched, injected module faults held still (they
        stood for the original forward). None when the model's output holds no scalar loss."""
        inputs, kwargs, poison = mb.inputs
        if row is not None:
            (inputs, kwargs) = row_of((inputs, kwargs), row, mb.rows)
            poison = poison.for_row(row) if poison else None
        held = self.ag.faults.held() if self.ag.faults is not None else contextlib.nullcontext()
        watch = FiniteWatch(self.ag.engine.module)
        with held, self.replaying(poison), torch.no_grad(), watch.watching():
            out = self.ag.engine.module(*inputs, **kwargs)
        loss = _scalar_loss(out)
        if loss is None:
            loss = _finite_proxy(out)
        if row is None and mb is self.ag.guard.book.healthy:
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
        held = self.ag.faults.held() if self.ag.faults is not None else contextlib.nullcontext()
        with held, self.replaying(poison), torch.no_grad():
            if rng is not None:
                set_rng_state(rng)
            else:
                torch.manual_seed(seed)
            out = self.ag.engine.module(*inputs, **kwargs)
        return tuple(None if v is None else float(v) for v in output_value(out))


def rows_of(batch) -> int | None:
    """The batch size: the leading dimension of the first tensor in the inputs."""
    def first(x):
        if isinstance(x, torch.Tensor):
            return x if x.dim() else None
        items = x.values() if isinstance(x, dict) else x if isinstance(x, (list, tuple)) else ()
        for v in items:
            t = first(v)
            if t is not None:
                return t
        return None

    t = first(batch)
    return int(t.shape[0]) if t is not None else None


def row_of(batch, row: int, rows: int | None):
    """One row of every tensor whose leading dimension is the batch size (a batch of one)."""
    def go(x):
        if isinstance(x, torch.Tensor):
            return x[row:row + 1] if x.dim() and x.shape[0] == rows else x
        if isinstance(x, dict):
            return type(x)((k, go(v)) for k, v in x.items())
        if isinstance(x, (list, tuple)):
            return type(x)(go(v) for v in x)
        return x

    return go(batch)


def _scalar_loss(out) -> float | None:
    """The loss in a model's output: a one-element tensor, an output object's or dict's ``loss``, or
    the first element of a tuple (Hugging Face models return ``(loss, logits, ...)`` or an output
    object)."""
    t = _loss_tensor(out)
    return None if t is None else float(t)


def rng_state() -> dict:
    """The random-number state a forward starts from: the host's, and the current accelerator's."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def output_value(out) -> tuple:
    """(the loss, the digest of every floating tensor) of a model's output, as device values (no host sync), or
    None where the output holds none (trainguard.bits.digest: its bits summed as integers)."""
    from trainguard.ports import digest

    loss = _loss_tensor(out)
    floats = []
    _walk(out, lambda t: floats.append(t) if t.is_floating_point() else None)
    return (loss, digest(floats) if floats else None)


def _loss_tensor(out):
    """The loss of :func:`_scalar_loss`, a 0-dim float tensor on its device, or None."""
    if isinstance(out, dict) or hasattr(out, "loss"):
        out = out.get("loss") if isinstance(out, dict) else getattr(out, "loss")
    elif isinstance(out, (list, tuple)) and out:
        out = out[0]
    return out.detach().float().reshape(()) if isinstance(out, torch.Tensor) and out.numel() == 1 else None


def _walk(x, fn) -> None:
    """``fn`` on every tensor of a model's output (tensors, dicts -- Hugging Face's output objects are dicts --, lists,
    tuples)."""
    if isinstance(x, torch.Tensor):
        fn(x)
    elif isinstance(x, dict):
        for v in x.values():
            _walk(v, fn)
    elif isinstance(x, (list, tuple)):
        for v in x:
            _walk(v, fn)


def _finite_proxy(out) -> float | None:
    """For a model whose output holds no loss (logits; the loop computes the loss outside): 0.0 when every
    floating value of the output is finite, NaN when one is not -- enough to tell a row that turns the
    output non-finite from the others, and weights that do from weights that do not (not a spike: that
    needs a loss). None when the output holds no floating tensor."""
    floats = []
    _walk(out, lambda t: floats.append(t) if t.is_floating_point() else None)
    return (0.0 if all(bool(torch.isfinite(t).all()) for t in floats) else float("nan")) if floats else None
