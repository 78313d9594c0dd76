"""Every RNG a training step may draw from: python, numpy, torch CPU, CUDA (when present).

Stored per rank as a tensor file loaded with ``weights_only=True`` (no pickled objects)."""
from __future__ import annotations

import random

import torch


def capture() -> dict:
    state = {"python": _py_to_lists(random.getstate()), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {"name": name, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                          "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    except ImportError:  # pragma: no cover
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: dict) -> None:
    random.setstate(_lists_to_py(state["python"]))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        n = state["numpy"]
        np.random.set_state((n["name"], n["keys"].numpy().astype("uint32"), n["pos"], n["has_gauss"],
                             n["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _py_to_lists(s):
    version, internal, gauss = s
    return [version, list(internal), gauss]


def _lists_to_py(s):
    version, internal, gauss = s
    return (version, tuple(internal), gauss)
