"""The guarded engine class: DeepSpeed's engine class, subclassed so that its ``forward``, ``backward``, ``step``,
``save_checkpoint``, ``load_checkpoint`` and ``destroy`` call the guard (``engine._trainguard``: its
ds_plugins.engine.EngineGuard) around DeepSpeed's own. ds_plugins.engine.attach swaps an engine's class for it
(``isinstance(engine, DeepSpeedEngine)`` still holds)."""
from __future__ import annotations

import torch

_GUARDED_CLASSES: dict[type, type] = {}


def _guarded_class(base: type) -> type:
    if base in _GUARDED_CLASSES:
        return _GUARDED_CLASSES[base]

    class Guarded(base):  # type: ignore[misc, valid-type]
        """DeepSpeed engine with trainguard's loop points (see trainguard.events.Event)."""

        def forward(self, *inputs, **kwargs):
            tg = self._trainguard
            return tg.surviving(lambda: tg.forward(super(Guarded, self).forward, inputs, kwargs),
                                lambda: torch.zeros((), requires_grad=True))

        def backward(self, loss, *args, **kwargs):
            tg = self._trainguard
            if tg.discard:  # (the rest of a step a replaced rank interrupted: the engine was rebuilt since)
                return None
            loss = tg.session.loss(self.global_steps + 1, loss)
            return tg.surviving(lambda: super(Guarded, self).backward(loss, *args, **kwargs))

        def step(self, *args, **kwargs):
            tg = self._trainguard
            if tg.discard:
                tg.discard = False
                return None
            if not self.is_gradient_accumulation_boundary():
                return tg.surviving(lambda: super(Guarded, self).step(*args, **kwargs), discard=False)
            return tg.surviving(lambda: tg.session.step(lambda: base.step(self, *args, **kwargs)), discard=False)

        def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True,  # noqa: B006 - DS's signature
                            exclude_frozen_parameters=False):
            """DeepSpeed's save, committed atomically with a manifest, sidecars and lineage."""
            cp = self._trainguard.checkpointer
            if cp is None:
                return super().save_checkpoint(save_dir, tag=tag, client_state=client_state,
                                               save_latest=save_latest,
                                               exclude_frozen_parameters=exclude_frozen_parameters)
            # no tag: DeepSpeed's own name (global_step<N>), which HF's resume and DeepSpeed's tools look for
            cp.save(save_dir, tag=tag if tag is not None else f"global_step{self.global_steps}",
                    client_state=client_state)
            return True

        def load_checkpoint(self, load_dir, tag=None, **kwargs):
            """DeepSpeed's load of the newest checkpoint that verifies (or ``tag``, verified first)."""
            cp = self._trainguard.checkpointer
            if cp is None:
                return super().load_checkpoint(load_dir, tag=tag, **kwargs)
            return cp.load(load_dir, tag=tag, **kwargs)

        def destroy(self, *args, **kwargs):
            self._trainguard.close()
            return super().destroy(*args, **kwargs)

    Guarded.__name__ = Guarded.__qualname__ = f"Trainguard{base.__name__}"
    _GUARDED_CLASSES[base] = Guarded
    return Guarded


def _plain_class(cls: type) -> type:
    """The DeepSpeed class under our guarded subclass."""
    return cls.__mro__[1] if cls.__name__.startswith("Trainguard") else cls
