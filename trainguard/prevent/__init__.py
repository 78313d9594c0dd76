"""Prevent: what keeps a run out of trouble before a step goes wrong -- gradient clipping thresholds (``clipping``:
norm, value, adaptive) and the start-of-run checks (``checks``: precision, warmup). The batch sanitiser is data's
(trainguard.data.sanitize).

May import trainguard.detectors (the streaming statistics adaptive clipping shares), trainguard.config and the
vocabulary.
"""
