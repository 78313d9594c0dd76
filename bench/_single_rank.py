"""Shared by the benchmarks: run as one rank without a launcher (what torchrun would set)."""
import os
from pathlib import Path


def single_rank_env(port_base: int) -> None:
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port_base + os.getpid() % 1000))
    # DeepSpeed's CPU communication op is compiled once and cached here (as in scripts/setup.sh)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions"))
