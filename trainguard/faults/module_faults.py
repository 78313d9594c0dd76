"""The faults that act through the model (trainguard.faults' part, one concept): forward hooks for inf_activation,
attention_collapse and sdc_compute on a named module, a forward pre-hook for nan_weights and bitflip on a named
parameter. ``self``: the run's trainguard.faults.injector.FaultInjector (its due faults, what fired, whether it is quiet).
"""
from __future__ import annotations

from typing import Sequence

import torch

from trainguard.config import FaultSpec


def _param_of(f: FaultSpec, names: Sequence[str]) -> str:
    """The parameter a fault with ``param`` acts on (default: the first), or a ValueError naming it."""
    name = f.param or names[0]
    if name not in names:
        raise ValueError(f"trainguard.faults: {f.type} param '{name}' is not a parameter of the model (first few: "
                         f"{', '.join(list(names)[:5])})")
    return name


def _standardised(x: torch.Tensor) -> torch.Tensor:
    """Per-query z-scores of attention logits over the keys a query may see (masked ones stay -inf):
    scaling these by a large factor collapses the head onto its top key, whatever the logits' scale.
    Every intermediate is computed on finite stand-ins, so no NaN reaches the backward pass."""
    finite = torch.isfinite(x)
    safe = torch.where(finite, x, torch.zeros_like(x))
    n = finite.sum(-1, keepdim=True).clamp_min(1)
    mean = safe.sum(-1, keepdim=True) / n
    dev = torch.where(finite, safe - mean, torch.zeros_like(x))
    std = torch.sqrt((dev * dev).sum(-1, keepdim=True) / n + 1e-12)
    return torch.where(finite, dev / (std + 1e-6), x)


def install_module_faults(self, model: torch.nn.Module, step_fn) -> list:
    """Forward hooks for inf_activation, attention_collapse, sdc_compute, nan_weights and bitflip; returns their
    handles."""
    modules = dict(model.named_modules())
    handles = []
    corrupt = [f for f in self.faults if f.type in ("nan_weights", "bitflip")]
    if corrupt:
        params = dict(model.named_parameters())
        target = {id(f): params[_param_of(f, list(params))] for f in corrupt}

        def corrupt_hook(m, args):
            if self.quiet:
                return None
            step = step_fn()
            for kind in ("nan_weights", "bitflip"):
                if kind == "bitflip" and (step, kind) in self._now:
                    continue  # (once per step: a second micro-batch's forward would flip it back)
                for f in self._due(kind, step):
                    self._fire(step, kind)
                    p = target[id(f)]
                    if p.numel():
                        with torch.no_grad():
                            if kind == "nan_weights":
                                p.data.view(-1)[0] = float("nan")
                            else:
                                flip_bit(p.data, f.bit)
            return None
        handles.append(model.register_forward_pre_hook(corrupt_hook))
    for f in self.faults:
        if f.type not in ("inf_activation", "attention_collapse", "sdc_compute"):
            continue
        if f.module not in modules:
            near = [n for n in modules if n and n.split(".")[-1] == f.module.split(".")[-1]][:5]
            raise ValueError(f"trainguard.faults: module '{f.module}' is not in the model"
                             + (f" (similar: {', '.join(near)})" if near else ""))
        mod = modules[f.module]
        if f.type == "sdc_compute":
            handles.append(mod.register_forward_hook(_sdc_hook(self, f, step_fn)))
        elif f.type == "inf_activation":
            def hook(m, args, output, f=f):
                if self.quiet:
                    return None
                step = step_fn()
                if not f.active(step) or (step, f.type) in self._spent:
                    return None
                self._fire(step, "inf_activation")
                if isinstance(output, torch.Tensor):
                    return output + float("inf")
                if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
                    return (output[0] + float("inf"), *output[1:])
                return None
            handles.append(mod.register_forward_hook(hook))
        else:
            def pre_hook(m, args, f=f):
                if self.quiet:
                    return None
                step = step_fn()
                if not f.active(step) or (step, f.type) in self._spent or not args or \
                        not isinstance(args[0], torch.Tensor):
                    return None
                self._fire(step, "attention_collapse")
                logits = args[0].clone()
                logits[:, f.head] = _standardised(logits[:, f.head]) * f.factor_or_default()
                return (logits, *args[1:])
            handles.append(mod.register_forward_pre_hook(pre_hook))
    return handles

def _sdc_hook(self, f: FaultSpec, step_fn):
    """sdc_compute: the module's output x (1 + eps) while the step is in the window. It ignores ``held()``:
    it stands for the device, which computes the replays of its steps as wrongly as their training forward;
    not spent by a step either (a re-run step on the same device is wrong again)."""
    factor = 1.0 + (f.eps if f.eps is not None else 1e-3)

    def hook(m, args, output):
        step = step_fn()
        if not f.active(step):
            return None
        self._fire(step, "sdc_compute")
        if isinstance(output, torch.Tensor) and output.is_floating_point():
            return output * factor
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            return (output[0] * factor, *output[1:])
        return None
    return hook


def flip_bit(t: torch.Tensor, bit: int) -> None:
    """Flip bit ``bit`` of ``t``'s first element in place (its bits read as an integer of the same width)."""
    from trainguard.ranks.bits import as_ints  # (the same reading of the bits the replica check sums)

    view = as_ints(t.view(-1)[:1])
    bit = bit % (8 * t.element_size())
    mask = torch.tensor(1 << bit if bit < 8 * t.element_size() - 1 else -(1 << bit), dtype=view.dtype)
    view.bitwise_xor_(mask.to(view.device))
