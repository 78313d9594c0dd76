"""A bench's figures kept under bench/results/: stamped with the date and the commit they were measured on."""
from __future__ import annotations

import datetime
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def keep(path: str | Path, figures: dict) -> None:
    """Write ``figures`` to ``path`` as JSON, after ``date``, ``commit`` (None outside a git checkout), ``clean``
    (whether the tree had no uncommitted change to tracked files: a figure of a dirty tree is not its commit's),
    ``machine`` and ``releases`` (what measured them)."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True)
    Path(path).write_text(json.dumps({"date": datetime.date.today().isoformat(),
                                      "commit": commit.stdout.strip() or None,
                                      "clean": None if dirty.returncode else not dirty.stdout.strip(),
                                      "machine": machine(), "releases": releases(), **figures},
                                     indent=1))


def machine() -> dict:
    """Where the figures were measured: the CPU (its model, the cores this process may use) and any GPU."""
    import os
    import platform

    model = None
    try:
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), None)
    except OSError:
        pass
    out = {"arch": platform.machine(), "cpu": model or platform.processor() or None,
           "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()}
    try:
        import torch

        if torch.cuda.is_available():
            out["gpu"] = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - (no torch, no CUDA: a CPU machine)
        pass
    return out


def releases() -> dict:
    """The releases the figures were measured with (the installed distributions; absent where not installed)."""
    import platform
    from importlib import metadata

    out = {"python": platform.python_version()}
    for dist in ("torch", "deepspeed", "transformers", "accelerate", "megatron-core"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out
