"""What the megatron-core adapter puts on the model chunks and reads back from them (a part of
megatron_hooks.guard.MegatronGuard, on its state): the gradient hooks, the forward hooks (a step's sampled probes, its
batch faults, the per-token loss on the last pipeline stage), the micro-batches recorded for a replay, the sample ids,
and the localisation of a non-finite step's first bad module."""
from __future__ import annotations

from typing import Sequence

import torch

from trainguard.ports import PoisonFirstLeaf

from megatron_hooks.parts import _unwrap


class ModelHooks:
    """MegatronGuard's hooks on its model chunks (``self``: the MegatronGuard, whose ``__init__`` sets what they
    keep between calls: ``_poison``, ``_poisoning``, ``_first_forward``, ``_probing``, ``_finite``)."""

    def _install_hooks(self) -> None:
        from trainguard.ports import install_grad_hooks

        named = [(n, p) for c in self.chunks for n, p in _unwrap(c).named_parameters() if p.requires_grad]
        check = self.guard is not None and self.cfg.detectors.nonfinite.enabled and \
            self.cfg.detectors.nonfinite.check_grads
        self._hooks += install_grad_hooks(named, self.faults, self.step_number, self._on_grad if check else None)
        for chunk in self.chunks:
            inner = _unwrap(chunk)
            self._hooks.append(inner.register_forward_pre_hook(self._on_forward_pre))
            self._hooks.append(inner.register_forward_hook(self._on_forward_done))
            if self.last_stage and (self.guard is not None or self.faults is not None):
                self._hooks.append(inner.register_forward_hook(self._on_output))
            if self.faults is not None:
                self._hooks += self.faults.install_module_faults(inner, self.step_number)

    def _on_grad(self, grad):
        self.session.backward(grad)
        return None

    def _on_forward_pre(self, module, args):
        if not module.training:  # evaluation passes (model.eval()) are not training steps
            return None
        step = self.step_number()
        if self._probing is None and self.guard is not None:  # the first micro-batch of the step opens the sampled probes
            self._probing = self.session.probing(step)
            self._probing.__enter__()
        # megatron's inputs are token ids: spike_batch scales this rank's loss (on the last pipeline stage, where the
        # loss is); nan_batch poisons the first leaf module's output (one row with `sample`), of the step's first
        # micro-batch only -- one bad sample, which replays with its micro-batch
        _, poison = self.session.forward(step, args, batch_faults=self._first_forward)
        if self._first_forward:
            self._poison = poison
            if poison is not None:
                self._poisoning = PoisonFirstLeaf(module, poison).__enter__()
        self._first_forward = False
        return None

    def _on_forward_done(self, module, args, output):
        if self._poisoning is not None:
            self._poisoning.__exit__(None, None, None)
            self._poisoning = None
        if module.training:  # (the step's own time: the straggler detector)
            self.session.forward_done()
        return None

    def record(self, drawn: list) -> None:
        """From the loop, after each training micro-batch's forward step: what this rank drew from its data
        iterator for it (megatron_hooks.replay.Recording), kept with its poison for a replay."""
        if self.guard is not None and self.guard.wants_batches:
            self.guard.record_micro_batch((list(drawn), self._poison), self.replayer.micro_batch_size)
        self._poison = None

    def _replay(self, mb, row):
        drawn, poison = mb.inputs
        return self.replayer.replay(drawn, poison, row)

    def _peer_replay(self, inputs, seed: int):
        """detectors.peer_replay: what a rank drew for a micro-batch (its own or its replica's), forward-only through
        megatron's schedule in eval mode (no random numbers drawn), the whole model-parallel group together.
        Returns (its loss, None): the schedule gives back the loss only."""
        (drawn, poison), _ = inputs  # (no RNG state: eval mode draws none)
        return self.replayer.replay(list(drawn), poison, None), None

    def _poison_forward(self, poison):
        return PoisonFirstLeaf(_unwrap(self.chunks[0]), poison)

    def _on_output(self, module, args, output):
        """Last stage: ``output`` is the per-token loss (labels were given); its mean is the local loss."""
        if not module.training or not isinstance(output, torch.Tensor) or not output.is_floating_point():
            return None
        scalar = output.detach().float().mean()
        seen = self.session.loss(self.step_number(), scalar)
        if seen is not scalar:  # a loss fault (nan_loss, spike) changed it: carry that into the real loss
            return output * (seen / scalar).to(output.dtype)
        return None

    def on_batch(self, sample_ids: Sequence[int] | None = None, position=None) -> None:
        """Optional, from your forward_step: this micro-batch's sample ids (named in verdicts).
        Ignored while the model is in eval mode (evaluation is not a training step)."""
        if self.guard is not None and all(_unwrap(c).training for c in self.chunks):
            self.guard.on_batch(list(sample_ids or []), position)

    def _localize(self) -> dict:
        if self._finite is None:
            return {"module": None, "note": "detectors.localize is off"}
        report = self._finite.first_nonfinite()
        report["rank"] = self.rank
        return report
