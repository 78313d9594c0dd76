import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# DeepSpeed's CPU op is compiled once per machine and cached here (see scripts/setup.sh).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions"))
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def root() -> Path:
    return ROOT
