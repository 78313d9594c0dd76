"""A model's inputs and outputs read one way for every framework (the replays: trainguard.replay.replay,
trainguard.detectors.peer_replay): the rows of a batch, the loss in an output, the digest of its floating values,
the random-number state a forward starts from."""
from __future__ import annotations

import torch

from trainguard.ranks.bits import digest


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


def scalar_loss(out) -> float | None:
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
    None where the output holds none (trainguard.ranks.bits.digest: its bits summed as integers)."""
    loss = _loss_tensor(out)
    floats = []
    _walk(out, lambda t: floats.append(t) if t.is_floating_point() else None)
    return (loss, digest(floats) if floats else None)


def _loss_tensor(out):
    """The loss of :func:`scalar_loss`, a 0-dim float tensor on its device, or None."""
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


def finite_proxy(out) -> float | None:
    """For a model whose output holds no loss (logits; the loop computes the loss outside): 0.0 when every
    floating value of the output is finite, NaN when one is not -- enough to tell a row that turns the
    output non-finite from the others, and weights that do from weights that do not (not a spike: that
    needs a loss). None when the output holds no floating tensor."""
    floats = []
    _walk(out, lambda t: floats.append(t) if t.is_floating_point() else None)
    return (0.0 if all(bool(torch.isfinite(t).all()) for t in floats) else float("nan")) if floats else None
