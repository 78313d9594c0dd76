"""Test support: the megatron-core releases the tests run, each either the installed one or a tree that
scripts/setup.sh installs beside it (``.venv/megatron-core-<version>``, exported as an environment
variable and put first on the workers' PYTHONPATH)."""
from __future__ import annotations

import os

BESIDE = {"0.16.1": "TRAINGUARD_MEGATRON_CORE_016", "0.17.1": "TRAINGUARD_MEGATRON_CORE_017",
          "0.19.2": "TRAINGUARD_MEGATRON_CORE_019"}


def installed() -> str:
    import megatron.core

    return megatron.core.__version__.split("+")[0]  # (0.19's carries the git hash of the folder it runs in)


def core_path(version: str) -> str | None:
    """None when ``version`` is the installed one, else the folder that holds it; raises LookupError
    (with what to do) when neither."""
    if installed() == version:
        return None
    path = os.environ.get(BESIDE[version], "")
    if not path or not os.path.isdir(os.path.join(path, "megatron", "core")):
        raise LookupError(f"megatron-core {version} is neither installed nor beside it: bash scripts/setup.sh test "
                          f"installs it in .venv/megatron-core-{version} and exports {BESIDE[version]}")
    return path
