"""After-import hooks, with no dependencies (the bootstrap loads this before anything else, as a
top-level module; the adapters import it as trainguard.bootstrap.site._trainguard_hook, through trainguard.bootstrap)."""
import functools
import importlib.abc
import importlib.util
import threading


def wrap_once(owner, attr: str, make) -> None:
    """Replace ``owner.attr`` by ``make(original)`` once (marked, so a second install is a no-op)."""
    original = getattr(owner, attr)
    if getattr(original, "_trainguard", False):
        return
    wrapper = functools.wraps(original)(make(original))
    wrapper._trainguard = True
    setattr(owner, attr, wrapper)


class AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``callback(name, module)`` right after one of ``names`` has executed: nothing is
    imported early, and the module is patched before anyone can use it."""

    def __init__(self, names, callback):
        self.names = tuple(names)
        self.callback = callback
        self._local = threading.local()

    def find_spec(self, name, path, target=None):
        if name not in self.names or getattr(self._local, "busy", False):
            return None
        self._local.busy = True
        try:
            spec = importlib.util.find_spec(name)  # (the real one: this finder steps aside meanwhile)
        finally:
            self._local.busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        real, callback = spec.loader, self.callback

        class _Then(importlib.abc.Loader):
            def create_module(self, spec):
                return real.create_module(spec)

            def exec_module(self, module):
                real.exec_module(module)
                callback(name, module)

        spec.loader = _Then()
        return spec
