"""Megatron-core adapter (forward hooks, parallel_state coordinates, grad-scaler fallback,
dist_checkpointing snapshots, a ``--trainguard-config`` argument for Megatron-LM).

Not built yet: this package exists so the distribution's layout is the one users install, and it
exposes nothing until the adapter lands (see the README's status table).
"""
__all__: list[str] = []
