"""The zero-code entry's import hooks (trainguard/bootstrap/site/_trainguard_hook.py), in one process: a patch
never touches a module whose own code is still running (issue 32: ``from transformers import Trainer`` ran
``transformers.trainer``, which imported Accelerate half-way, whose hook patched the half-executed module)."""
import sys
import textwrap

import pytest

from trainguard.bootstrap import AfterImport, flush, when_complete


@pytest.fixture
def packages(tmp_path, monkeypatch):
    """``outer`` imports ``inner`` half-way through its own code, then defines ``Trainer``; ``later`` is
    unrelated. Cleaned from sys.modules and sys.meta_path afterwards."""
    (tmp_path / "tg_outer.py").write_text(textwrap.dedent("""
        BEFORE = 1
        import tg_inner  # (its after-import hook runs here, while this module has no Trainer yet)
        class Trainer:
            def train(self):
                return "original"
    """))
    (tmp_path / "tg_inner.py").write_text("X = 1\n")
    (tmp_path / "tg_later.py").write_text("Y = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    finders = list(sys.meta_path)
    yield
    sys.meta_path[:] = finders
    for name in ("tg_outer", "tg_inner", "tg_later"):
        sys.modules.pop(name, None)


def patch_trainer(module):
    original = module.Trainer.train  # (AttributeError on a half-executed module: the bug)
    module.Trainer.train = lambda self: "patched:" + original(self)


def test_a_module_still_executing_is_patched_once_its_code_returned(packages):
    seen = []

    def on_inner(name, module):  # an entry loaded half-way through tg_outer, as Accelerate's hook loads ours
        outer = sys.modules["tg_outer"]
        seen.append(hasattr(outer, "Trainer"))
        when_complete(outer, patch_trainer)

    sys.meta_path.insert(0, AfterImport(("tg_inner",), on_inner))
    import tg_outer

    assert seen == [False]  # the hook really ran mid-import
    assert tg_outer.Trainer().train() == "original"  # nothing touched yet, nothing raised
    import tg_later  # noqa: F401 - the next import anywhere lands the patch
    assert tg_outer.Trainer().train() == "patched:original"
    flush()
    assert tg_outer.Trainer().train() == "patched:original"  # once


def test_an_explicit_flush_lands_it_without_another_import(packages):
    sys.meta_path.insert(0, AfterImport(("tg_inner",), lambda n, m: when_complete(sys.modules["tg_outer"],
                                                                                 patch_trainer)))
    import tg_outer

    flush()  # (what the wrappers do when entered: Accelerator.__init__, which the Trainer calls in its own __init__)
    assert tg_outer.Trainer().train() == "patched:original"


def test_a_complete_module_is_patched_at_once_even_inside_its_own_after_import_hook(packages):
    """An AfterImport callback runs after the module's code returned but before importlib clears its
    ``_initializing`` mark: that module counts as complete (else ``import deepspeed`` then
    ``deepspeed.initialize`` with no import between would run unpatched)."""
    def on_outer(name, module):
        when_complete(module, patch_trainer)

    sys.meta_path.insert(0, AfterImport(("tg_outer",), on_outer))
    import tg_outer

    assert tg_outer.Trainer().train() == "patched:original"
