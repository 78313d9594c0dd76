"""Replays on an anomaly step: data or weights, which sample (``replay``, ``replays``), the first module that produced a
non-finite value (``localize``, ``probes``), forwards again through a module (``module_replays``, ``outputs``), and a
micro-batch sent to the data-parallel peer that replays it (``p2p``).

May import trainguard.faults, trainguard.ranks and the vocabulary.
"""
