"""Liveness: heartbeats and the watchdog that names a hung rank (``heartbeats``, ``watchdog``, ``hung``), and the
supervised job -- the supervisor (``supervise``), a process's place in the world (``world``, ``spare``) and a survivor's
way through a rank's replacement (``replacement``).

May import trainguard.checkpoint (its durable file writes), trainguard.metrics, trainguard.ranks, trainguard.config and
the vocabulary.
"""
