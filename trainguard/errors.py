"""One exception tree. Each error says what failed, on which rank where it matters, and what to do."""
from __future__ import annotations


class TrainguardError(Exception):
    """Base of every error trainguard raises on purpose."""


class ConfigError(TrainguardError, ValueError):
    """The "trainguard" block (or the file holding it) is invalid.

    ``problems`` lists every problem found, each as ``(path, message)`` with the full key path
    (``trainguard.detectors.nonfinite.actoin``), so one run of ``trainguard validate`` shows them all.
    """

    def __init__(self, problems: list[tuple[str, str]], source: str | None = None):
        self.problems = list(problems)
        self.source = source
        where = f" in {source}" if source else ""
        lines = [f"{len(self.problems)} problem(s) in the trainguard config{where}:"]
        lines += [f"  {path}: {msg}" for path, msg in self.problems]
        super().__init__("\n".join(lines))


class TrainguardAbort(TrainguardError):
    """Every rank raises this together when the policy decides the run cannot go on.

    ``report`` is the JSON-serialisable report also written to the event log: the step, the
    culprit ranks and their coordinates, the sample ids and what was tried.
    """

    def __init__(self, message: str, report: dict | None = None):
        self.report = report or {}
        super().__init__(message)


def interruption(error: BaseException | None) -> dict:
    """What the run_end record says of an exception that ended the training loop: ``{"interrupted": "Type: message"}``
    (a peer died, the launcher stopped the job; the message's first line); nothing for none, trainguard's own abort
    (its record says it), or an exit with status 0 (Megatron-LM's --exit-interval, a signal handler's clean exit)."""
    if error is None or isinstance(error, (TrainguardAbort, SystemExit)) and getattr(error, "code", 0) in (0, None):
        return {}  # (an abort is its own record, said as such)
    said = (str(error).strip().splitlines() or [""])[0]
    if isinstance(error, KeyboardInterrupt):
        return {"interrupted": "KeyboardInterrupt (Ctrl-C, or a signal)"}
    return {"interrupted": (f"{type(error).__name__}: {said}" if said else type(error).__name__)[:200]}


class UnsupportedSetup(TrainguardError):
    """The framework is configured in a way the guard cannot protect (named in the message)."""


class FallbackUnavailable(TrainguardError):
    """The framework cannot continue in bf16 here (the loss_scale ladder's ``bf16_fallback`` rung); the message
    says why and what to do instead. Raised by the adapters' precision modules; the driver turns it into the
    ladder's next rung (an abort with its report)."""
