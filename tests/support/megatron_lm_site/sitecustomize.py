"""Test-only, on PYTHONPATH of the Megatron-LM runs (tests/dist/test_megatron_lm_dist.py): the CPU
layer (tests/support/megatron_cpu.enable_lm) switched on right after ``megatron.core`` is imported,
so that Megatron-LM's unmodified ``pretrain_gpt.py`` runs on a CPU. trainguard's own bootstrap
(``trainguard run``) shadows this file and runs it after itself, as it does any sitecustomize.
Never shipped: the product carries no CPU layer."""
import os
import sys
import typing

if not hasattr(typing, "override"):  # Megatron-LM core_v0.19's megatron.training uses it (Python 3.12+)
    import typing_extensions

    typing.override = typing_extensions.override

sys.path.insert(0, os.environ["TRAINGUARD_TEST_ROOT"])  # (tests.support, from the repository)
from trainguard.bootstrap import AfterImport  # noqa: E402


def _cpu(name, module):
    from tests.support import megatron_cpu

    if name == "megatron.core":
        megatron_cpu.enable_lm()
    else:
        megatron_cpu.enable_lm_training()


sys.meta_path.insert(0, AfterImport(("megatron.core", "megatron.training"), _cpu))
