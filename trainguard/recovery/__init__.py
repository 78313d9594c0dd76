"""Recover: verdicts into one action (``policy``: ladders, budgets; pure), how far to lower the LR (``lrcut``) and how the
lowered LR reaches the framework (``lrapply``), a recovery that fails degrading instead of killing (``degrade``), and
the ranks suspected again and again (``suspects``).

May import trainguard.checkpoint, trainguard.ranks, trainguard.config and the vocabulary.
"""
