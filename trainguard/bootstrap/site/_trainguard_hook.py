"""After-import hooks, with no dependencies (the bootstrap loads this before anything else, as a
top-level module; the adapters import it as trainguard.bootstrap.site._trainguard_hook, through trainguard.bootstrap).

Import-order proof: a patch never touches a module whose own code is still running. A user's
``from transformers import Trainer`` executes ``transformers.trainer``, which imports Accelerate half-way,
whose after-import hook loads the zero-code entry -- while ``transformers.trainer`` has no ``Trainer`` yet.
:func:`when_complete` runs such a patch later: at the next import anywhere (every :class:`AfterImport`
finder flushes first), or when a wrapper of ours is entered (they call :func:`flush`) -- whichever comes
first after the module's code returned. (Each copy of this module -- the bootstrap's top-level one, the adapters'
``trainguard.bootstrap.site._trainguard_hook`` -- keeps its own list, flushed by its own finders and callers.)"""
import functools
import importlib.abc
import importlib.util
import sys
import threading

_PENDING = []  # (module, patch) whose module was still executing when asked
_LOCK = threading.Lock()


def executing(module) -> bool:
    """True while ``module``'s own code is still running: importlib marks its spec ``_initializing`` until
    its import returns; an :class:`AfterImport` callback runs in between, once the code has returned (marked)."""
    spec = getattr(module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False)) and not getattr(spec, "_trainguard_returned", False)


def when_complete(module, patch) -> None:
    """``patch(module)`` now if the module's import has completed, else once it has (see the module doc)."""
    if not executing(module):
        patch(module)
        return
    with _LOCK:
        _PENDING.append((module, patch))


def flush() -> None:
    """Run the patches whose module has completed since (cheap when none wait)."""
    if not _PENDING:
        return
    with _LOCK:
        ready = [item for item in _PENDING if not executing(item[0])]
        for item in ready:
            _PENDING.remove(item)
    for module, patch in ready:
        if sys.modules.get(module.__name__) is module:  # (an import that failed left nothing to patch)
            patch(module)


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
        flush()  # (any import is a moment after which a module that was executing may have completed)
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
                spec._trainguard_returned = True  # (its code ran to the end: see executing())
                callback(name, module)

        spec.loader = _Then()
        return spec
