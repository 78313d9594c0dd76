"""trainguard: the framework-free core.

Only torch, the standard library and pydantic are imported here; the DeepSpeed adapter lives in
``ds_plugins`` and the Megatron adapter in ``megatron_hooks``. The layout follows
``shared/docs/DESIGN.md``: config -> detectors (pure verdicts) -> policy (actions) -> guard (the
per-step state machine) -> metrics sinks.
"""
__version__ = "0.1.0"

from trainguard.errors import ConfigError, TrainguardAbort, TrainguardError  # noqa: E402

__all__ = ["__version__", "ConfigError", "TrainguardAbort", "TrainguardError"]
