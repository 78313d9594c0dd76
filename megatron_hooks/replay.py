"""Data or weights on megatron (trainguard.replay.replay): a recorded micro-batch, or one of its rows, run
again forward-only on the current weights through the framework's own forward-backward function.

megatron's forward is its pipeline schedule, collective inside a model-parallel group: a tensor-
parallel forward all-reduces, a pipeline stage receives its input from the previous one. So every
rank of the group replays together, each with what *it* drew from its data iterator for that
micro-batch (Megatron-LM: tensor-parallel rank 0 reads and broadcasts, the first and last stages
read), through ``get_forward_backward_func()(..., forward_only=True)``; the loss, which only the last
stage computes, is broadcast over the pipeline group, so every rank of the group holds the same
value and takes the same decisions (StepGuard's ``replay_peers``).

A replay runs with the model chunks in eval mode: no dropout (no random numbers drawn, the run's RNG
untouched) and none of trainguard's training hooks firing (they watch training forwards only);
injected module faults hold still; the micro-batch's own poison (a ``nan_batch`` sample) comes with it.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import torch

from trainguard.ports import row_of

__all__ = ["Recording", "Replayer"]


class Recording:
    """A data iterator that keeps what the forward step drew from it (references, no copies)."""

    def __init__(self, inner):
        self.inner = inner
        self.drawn: list = []

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self.inner)
        self.drawn.append(item)
        return item

    def __getattr__(self, name):  # (a framework may ask its iterator for more than next())
        return getattr(self.inner, name)


def _scalar(reduced: Any) -> float | None:
    """The loss of one micro-batch from what the loss function reported (Megatron-LM: ``{"lm loss":
    tensor([sum, tokens])}`` from core_v0.18, ``(sum, tokens)`` or a mean before), or None."""
    if isinstance(reduced, dict):
        values = list(reduced.values())
        reduced = values[0] if values else None
    if isinstance(reduced, (tuple, list)) and len(reduced) == 2:
        total, count = (float(torch.as_tensor(x).float().sum()) for x in reduced)
        return total / count if count else float("nan")
    if isinstance(reduced, torch.Tensor):
        flat = reduced.detach().float().flatten()
        if flat.numel() == 2:
            return float(flat[0] / flat[1]) if float(flat[1]) else float("nan")
        return float(flat.mean()) if flat.numel() else None
    if isinstance(reduced, (int, float)):
        return float(reduced)
    return None


class Replayer:
    """Forward-only replays through megatron's schedule. ``forward_step_func``: the loop's own (the one
    that reads a batch from ``data_iterator`` and returns ``(output, loss_func)``); ``seq_length`` and
    ``micro_batch_size`` as the loop passes them to the forward-backward function; ``args``: a namespace
    whose ``micro_batch_size`` the forward step reads (Megatron-LM's), set to 1 while one row replays. A forward
    step of yours must take the batch size from the batch it reads (a row replays as a batch of one)."""

    def __init__(self, chunks: Sequence[torch.nn.Module], forward_step_func: Callable, seq_length: int,
                 micro_batch_size: int, args=None, poison_module: Callable[[Any], Any] | None = None):
        self.chunks = list(chunks)
        self.forward_step_func = forward_step_func
        self.seq_length = seq_length
        self.micro_batch_size = micro_batch_size
        self.args = args
        self.poison_module = poison_module  # (the adapter's: the micro-batch's nan_batch poison around a forward)
        self.held: Callable[[], Any] = contextlib.nullcontext

    def replay(self, drawn: list, poison, row: int | None) -> float | None:
        """The loss of the recorded micro-batch (``drawn``: what this rank drew for it), or of its row ``row``,
        the same on every rank of the model-parallel group. Collective: every rank of the group calls it."""
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        size = self.micro_batch_size
        if row is not None:
            drawn = [row_of(item, row, size) for item in drawn]  # (a tensor with another first dimension: whole)
            poison = poison.for_row(row) if poison is not None else None
            size = 1
        modes = [c.training for c in self.chunks]
        saved = getattr(self.args, "micro_batch_size", None)
        try:
            for c in self.chunks:
                c.eval()
            if self.args is not None:
                self.args.micro_batch_size = size
            with self.held(), torch.no_grad(), \
                    (self.poison_module(poison) if poison is not None and self.poison_module else contextlib.nullcontext()):
                data = iter(drawn)
                out = get_forward_backward_func()(
                    forward_step_func=self.forward_step_func,
                    data_iterator=[data] * len(self.chunks) if len(self.chunks) > 1 else data,
                    model=self.chunks, num_microbatches=1, seq_length=self.seq_length, micro_batch_size=size,
                    forward_only=True)
        finally:
            if self.args is not None:
                self.args.micro_batch_size = saved
            for c, mode in zip(self.chunks, modes):
                c.train(mode)
        loss = _scalar(out[0]) if ps.is_pipeline_last_stage() and out else None
        if ps.get_pipeline_model_parallel_world_size() > 1:  # (a loss, and whether there was one)
            value = torch.tensor([0.0 if loss is None else loss, float(loss is not None)], dtype=torch.float64,
                                 device=_device())
            torch.distributed.broadcast(value, ps.get_pipeline_model_parallel_last_rank(),
                                        group=ps.get_pipeline_model_parallel_group())
            loss = float(value[0]) if float(value[1]) else None
        return loss


def _device() -> torch.device:
    from trainguard.ports import collective_device

    return torch.device(collective_device())
