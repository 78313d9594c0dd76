"""The step: the loop points every adapter calls, in order, and the decision each step takes before anything is applied.

``session`` is one rank's trainguard (the only caller of the loop points), ``driver`` the step sequence written once for
every framework, ``guard`` the per-step state machine; ``tally`` and ``gradhooks`` collect what a rank saw, ``agreement``
is AGREE (every rank's row in, one agreed view out), ``evidence`` and ``judgement`` are DECIDE, ``appliedgrad``,
``metricline`` and ``steptime`` measure what the step applied and took.

May import every room below it (docs/architecture.md); only the doors above it (``trainguard.ports``) and the adapters
(``trainguard.step.session``, their one way into a rank's run) import it.
"""
