"""What a worker of the HF / Accelerate tests reports, once per rank: its losses and engine counters, a digest
of its parameters (replicas and runs compared bit for bit) -- then the exit every script should make
(shared/docs/PLATFORM.md: destroy the engine and the process group, or gloo sometimes aborts at exit).

Even so, one CI run (stop 29) saw a Trainer run with trainguard *off* finish, write its results and then die
in interpreter finalisation ("terminate called without an active exception", SIGABRT, rc 1 from torchrun):
a C++ thread still joinable when the process tears down. So ``finish`` ends the process itself: the atexit
handlers run (trainguard's run_end record and log flush among them), the streams are flushed, and the
process leaves with ``os._exit`` before finalisation can abort it."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import NoReturn

import torch

from trainguard.demo.run import leave


def finish(out: Path, model, engine, **fields) -> NoReturn:
    """Write ``out/result.rank<RANK>.json`` (named by RANK: Accelerate on CPU may report process_index 0
    everywhere) with ``fields``, the parameters' sha256 and finiteness, the engine's class and counters; then
    destroy the engine and the process group, and exit 0 (above). ``model``: the unwrapped module."""
    rank = int(os.environ.get("RANK", "0"))
    params = [p.detach().float().cpu() for p in model.parameters()]
    digest = hashlib.sha256()
    for p in params:
        digest.update(p.numpy().tobytes())
    result = {"rank": rank, "engine_class": type(engine).__name__, "engine_steps": getattr(engine, "global_steps", None),
              "skipped_steps": getattr(engine, "skipped_steps", None), "param_sha256": digest.hexdigest(),
              "weights_finite": all(bool(torch.isfinite(p).all()) for p in params), **fields}
    (out / f"result.rank{rank}.json").write_text(json.dumps(result, indent=1))
    if hasattr(engine, "destroy"):
        engine.destroy()
    torch.distributed.destroy_process_group()
    leave(0)
