"""What the megatron-core adapter puts on the model chunks and reads back from them (a part of
megatron_hooks.guard.MegatronGuard, on its state): the gradient hooks, the forward hooks (a step's sampled probes, its
batch faults, the per-token loss on the last pipeline stage), the micro-batches recorded for a replay, the sample ids,
and the localisation of a non-finite step's first bad module."""
from __future__ import annotations

from typing import Sequence

import torch

from trainguard.ports import OutputFlags, PoisonFirstLeaf

from megatron_hooks.parts import _modules, _unwrap


class ModelHooks:
    """The hooks of one MegatronGuard (``mg``) on its model chunks, and what they keep between calls."""

    def __init__(self, mg):
        self.mg = mg
        self.poison = None          # this micro-batch's nan_batch poison (an integer batch: at the first leaf)
        self._poisoning = None
        self._first_forward = True  # the step's first training forward (its first micro-batch) is still to come
        self._probing = None        # the step's sampled probes, open from its first forward to its optimizer step
        self.finite = None          # trainguard.replay.localize.OutputFlags: each module's output finite (detectors.localize)

    def install(self, localize: bool) -> None:
        """Fault hooks first, so that the finiteness flags (``localize``) see what they did."""
        from trainguard.ports import install_grad_hooks

        mg = self.mg
        named = [(n, p) for c in mg.chunks for n, p in _unwrap(c).named_parameters() if p.requires_grad]
        check = mg.guard is not None and mg.cfg.detectors.nonfinite.enabled and mg.cfg.detectors.nonfinite.check_grads
        # (the check where megatron's DDP reduces each bucket group -- its local gradients, accumulated -- else hooks)
        points = [(g, "start_grad_sync", lambda *a, g=g, **k: [] if getattr(g, "grad_reduce_handle", None) is not None
                   else [b.grad_data for b in g.buckets] + [p.main_grad for b in g.buckets for p in getattr(
                       b, "params_with_extra_main_grads", ())]) for c in mg.chunks for groups in (getattr(
                           c, "bucket_groups", None), getattr(c, "expert_parallel_bucket_groups", None)) for g in groups or ()]
        add, add_all = mg.session.grad_checks if check else (None, None)
        mg._hooks += install_grad_hooks(named, mg.faults, mg.step_number, add, (), points, add_all)
        for chunk in mg.chunks:
            inner = _unwrap(chunk)
            mg._hooks.append(inner.register_forward_pre_hook(self._on_forward_pre))
            mg._hooks.append(inner.register_forward_hook(self._on_forward_done))
            if mg.last_stage and (mg.guard is not None or mg.faults is not None):
                mg._hooks.append(inner.register_forward_hook(self._on_output))
            if mg.faults is not None:
                mg._hooks += mg.faults.install_module_faults(inner, mg.step_number)
        if localize:
            self.finite = OutputFlags(_modules(mg.chunks), mg.stage)
            mg._hooks.append(self.finite)

    def step_begins(self) -> None:
        """At ``optimizer.step()``: the step's forwards are done (its probes close; the next forward is a first)."""
        self._first_forward = True
        if self._probing is not None:
            self._probing.__exit__(None, None, None)
            self._probing = None

    def step_ended(self) -> None:
        if self.finite is not None:
            self.finite.reset()

    def _on_forward_pre(self, module, args):
        if not module.training:  # evaluation passes (model.eval()) are not training steps
            return None
        step = self.mg.step_number()
        if self._probing is None and self.mg.guard is not None:  # the first micro-batch of the step opens the sampled probes
            self._probing = self.mg.session.probing(step)
            self._probing.__enter__()
        # megatron's inputs are token ids: spike_batch scales this rank's loss (on the last pipeline stage, where the
        # loss is); nan_batch poisons the first leaf module's output (one row with `sample`), of the step's first
        # micro-batch only -- one bad sample, which replays with its micro-batch
        _, poison = self.mg.session.forward(step, args, batch_faults=self._first_forward)
        if self._first_forward:
            self.poison = poison
            if poison is not None:
                self._poisoning = PoisonFirstLeaf(module, poison).__enter__()
        self._first_forward = False
        return None

    def _on_forward_done(self, module, args, output):
        if self._poisoning is not None:
            self._poisoning.__exit__(None, None, None)
            self._poisoning = None
        if module.training:  # (the step's own time: the straggler detector)
            self.mg.session.forward_done()
        return None

    def record(self, drawn: list) -> None:
        """From the loop, after each training micro-batch's forward step: what this rank drew from its data
        iterator for it (megatron_hooks.replay.Recording), kept with its poison for a replay."""
        replays = self.mg.session.replays
        if replays is not None and replays.wants_batches:
            replays.record((list(drawn), self.poison), self.mg.replayer.micro_batch_size)
        self.poison = None

    def replay(self, mb, row):
        drawn, poison = mb.inputs
        return self.mg.replayer.replay(drawn, poison, row)

    def peer_replay(self, inputs, seed: int):
        """detectors.peer_replay: what a rank drew for a micro-batch (its own or its replica's), forward-only through
        megatron's schedule in eval mode (no random numbers drawn), the whole model-parallel group together.
        Returns (its loss, None): the schedule gives back the loss only."""
        (drawn, poison), _ = inputs  # (no RNG state: eval mode draws none)
        return self.mg.replayer.replay(list(drawn), poison, None), None

    def poison_forward(self, poison):
        return PoisonFirstLeaf(_unwrap(self.mg.chunks[0]), poison)

    def _on_output(self, module, args, output):
        """Last stage: ``output`` is the per-token loss (labels were given); its mean is the local loss."""
        if not module.training or not isinstance(output, torch.Tensor) or not output.is_floating_point():
            return None
        scalar = output.detach().float().mean()
        seen = self.mg.session.loss(self.mg.step_number(), scalar)
        if seen is not scalar:  # a loss fault (nan_loss, spike) changed it: carry that into the real loss
            return output * (seen / scalar).to(output.dtype)
        return None

    def on_batch(self, sample_ids: Sequence[int] | None = None, position=None) -> None:
        """Optional, from your forward_step: this micro-batch's sample ids (named in verdicts).
        Ignored while the model is in eval mode (evaluation is not a training step)."""
        if self.mg.guard is not None and all(_unwrap(c).training for c in self.mg.chunks):
            self.mg.guard.on_batch(list(sample_ids or []), position)

    def localize(self) -> dict:
        if self.finite is None:
            return {"module": None, "note": "detectors.localize is off"}
        report = self.finite.first_nonfinite()
        report["rank"] = self.mg.rank
        return report
