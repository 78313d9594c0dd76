"""Forward probes: module hooks that exist only while they are needed.

Nothing is registered on an ordinary step, so a healthy, unsampled step pays nothing. The adapter
opens a probe around the forward of a *sampled* step (activation range, attention entropy), or
around a *replay* of the last micro-batch after a non-finite verdict (localisation):

- :class:`RangeProbe`: per-module max-abs and RMS of the output (device tensors; read once at AGREE).
- :class:`EntropyProbe`: per-layer, per-head entropy of attention probabilities
  ``[batch, heads, queries, keys]`` and its ratio to the maximum, ``log(keys attended)``.
- :func:`first_nonfinite`: the first module, in the order modules *finish* their forward, whose
  output holds NaN/Inf -- the innermost module where the non-finite value appeared (what
  ``torch.autograd.detect_anomaly`` would narrow down, for the cost of one replayed forward).
"""
from __future__ import annotations

import re
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterator

import torch


def _first_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, torch.Tensor):
                return o
    if isinstance(out, dict):
        for o in out.values():
            if isinstance(o, torch.Tensor):
                return o
    return None


def select_modules(model: torch.nn.Module, pattern: str | None, leaves_by_default: bool = True):
    """``(path, module)`` pairs whose path matches ``pattern`` (default: every leaf module)."""
    out = []
    rx = re.compile(pattern) if pattern else None
    for name, m in model.named_modules():
        if not name:
            continue
        if rx is not None:
            if rx.search(name):
                out.append((name, m))
        elif leaves_by_default and not any(True for _ in m.children()):
            out.append((name, m))
    return out


@contextmanager
def hooked(modules, make_hook: Callable[[str], Callable]) -> Iterator[None]:
    handles = [m.register_forward_hook(make_hook(name)) for name, m in modules]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


class RangeProbe:
    """Max-abs and RMS of each watched module's output, on the first micro-batch of a sampled step."""

    def __init__(self, modules):
        self.modules = modules
        self.stats: dict[str, torch.Tensor] = {}

    @contextmanager
    def watch(self) -> Iterator[None]:
        def make(name):
            def hook(m, args, out):
                t = _first_tensor(out)
                if t is None or not t.is_floating_point() or name in self.stats or t.numel() == 0:
                    return None
                with torch.no_grad():
                    x = t.detach().float()
                    # [max|x|, rms]: a NaN/Inf anywhere makes max-abs non-finite (reported as such)
                    self.stats[name] = torch.stack([x.abs().amax(), x.square().mean().sqrt()])
                return None
            return hook

        with hooked(self.modules, make):  # the training forward itself keeps its graph
            yield

    def collect(self) -> dict[str, tuple[float, float]]:
        """Host values (one synchronisation, on sampled steps only); clears the probe."""
        if not self.stats:
            return {}
        names = list(self.stats)
        values = torch.stack([self.stats[n] for n in names]).cpu().tolist()
        self.stats = {}
        return {n: (v[0], v[1]) for n, v in zip(names, values)}


class EntropyProbe:
    """Attention entropy per watched softmax module and head."""

    def __init__(self, modules):
        self.modules = modules
        self.stats: dict[str, torch.Tensor] = {}

    @staticmethod
    def entropy(probs: torch.Tensor) -> torch.Tensor:
        """``[2, heads]``: mean entropy in nats, and its ratio to the maximum per query (log of the
        number of keys with non-zero probability: a causal mask lets query i see i+1 keys)."""
        p = probs.detach().float()
        if p.dim() == 3:
            p = p.unsqueeze(0)
        h = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)           # [b, heads, q]
        n = (p > 0).sum(-1).clamp_min(1).float()
        hmax = torch.log(n)
        mask = (n > 1).float()                                        # queries with a choice to make
        ratio = (h * mask).sum((0, 2)) / (hmax * mask).sum((0, 2)).clamp_min(1e-12)
        return torch.stack([h.mean((0, 2)), ratio])

    @contextmanager
    def watch(self) -> Iterator[None]:
        def make(name):
            def hook(m, args, out):
                t = _first_tensor(out)
                if t is None or t.dim() < 3 or name in self.stats:
                    return None
                with torch.no_grad():
                    self.stats[name] = self.entropy(t)
                return None
            return hook

        with hooked(self.modules, make):
            yield

    def collect(self) -> dict[str, dict[str, list[float]]]:
        if not self.stats:
            return {}
        out = {}
        for n, v in self.stats.items():
            v = v.cpu()
            out[n] = {"entropy": v[0].tolist(), "ratio": v[1].tolist()}
        self.stats = {}
        return out


def first_nonfinite(model: torch.nn.Module, run: Callable[[], Any]) -> dict:
    """Run ``run()`` (a forward of ``model``) with a hook on every module; report the first module
    whose output is non-finite. One host sync per module: alarm path only."""
    found: dict = {}
    order = [0]

    def make(name):
        def hook(m, args, out):
            order[0] += 1
            if found:
                return None
            t = _first_tensor(out)
            if t is None or not t.is_floating_point():
                return None
            finite = torch.isfinite(t)
            if not bool(finite.all()):
                found.update({"module": name, "type": type(m).__name__, "order": order[0],
                              "kind": "nan" if bool(torch.isnan(t).any()) else "inf",
                              "fraction_nonfinite": round(1.0 - float(finite.float().mean()), 6)})
            return None
        return hook

    modules = [(n, m) for n, m in model.named_modules() if n]
    with torch.no_grad(), hooked(modules, make):
        run()
    if not found:
        return {"module": None, "note": "every module output was finite: the non-finite value arose in the "
                "loss or in the backward pass", "modules_checked": order[0]}
    found["modules_checked"] = order[0]
    return found


class FiniteWatch:
    """Whether every module output of a forward stayed finite: one device flag ANDed by a hook on every
    module, read once at the end (one host sync per replay, not per module). For replays: a sample can
    make an intermediate activation infinite while the output stays finite (a saturating tanh, a
    softmax), and its gradients are then NaN -- the output or the loss alone would call it healthy."""

    def __init__(self, model: torch.nn.Module):
        self.modules = [(n, m) for n, m in model.named_modules() if n]
        self.flag: torch.Tensor | None = None

    @contextmanager
    def watching(self) -> Iterator["FiniteWatch"]:
        self.flag = None

        def make(name):
            def hook(m, args, out):
                t = _first_tensor(out)
                if t is not None and t.is_floating_point():
                    ok = torch.isfinite(t).all()
                    self.flag = ok if self.flag is None else self.flag & ok
                return None
            return hook

        with hooked(self.modules, make):
            yield self

    def finite(self) -> bool:
        return True if self.flag is None else bool(self.flag)


@contextmanager
def preserved_rng(devices=()) -> Iterator[None]:
    """A replay must not consume the training run's random numbers (dropout)."""
    with torch.random.fork_rng(devices=list(devices), enabled=True):
        yield


class SampledProbes:
    """The model's activation-range and attention-entropy probes (``detectors``: the config's section), opened
    around the forward of their sampled steps only."""

    def __init__(self, detectors):
        self.d = detectors
        self.range: RangeProbe | None = None
        self.entropy: EntropyProbe | None = None

    def attach(self, model: torch.nn.Module) -> None:
        """Choose the modules they watch (hooks are added only on sampled steps)."""
        if self.d.activation_range.enabled:
            self.range = RangeProbe(select_modules(model, self.d.activation_range.modules))
        if self.d.attention_entropy.enabled:
            mods = select_modules(model, self.d.attention_entropy.modules, leaves_by_default=False)
            self.entropy = EntropyProbe(mods) if mods else None

    def sampled(self, step: int) -> list[str]:
        out = []
        if self.range is not None and step % self.d.activation_range.every == 0:
            out.append("activation_range")
        if self.entropy is not None and step % self.d.attention_entropy.every == 0:
            out.append("attention_entropy")
        return out

    @contextmanager
    def probing(self, step: int) -> Iterator[None]:
        which = self.sampled(step)
        with ExitStack() as stack:
            if "activation_range" in which:
                stack.enter_context(self.range.watch())
            if "attention_entropy" in which:
                stack.enter_context(self.entropy.watch())
            yield

    def collect(self, sampled: list[str]) -> tuple[Any, Any]:
        """At DECIDE of a sampled step: (activation values, entropy values), None where not sampled."""
        return (self.range.collect() if "activation_range" in sampled else None,
                self.entropy.collect() if "attention_entropy" in sampled else None)

    def describe(self) -> dict:
        return {"activation_modules": len(self.range.modules) if self.range else 0,
                "attention_modules": [n for n, _ in self.entropy.modules] if self.entropy else []}
