"""Detectors: pure functions from gathered observations to verdicts. No I/O, no collectives, no
framework imports; the policy (``trainguard.recovery.policy``) decides what to do about a verdict. Their
streaming statistics are ``stats``.

May import trainguard.replay (the peer replay's exchange), trainguard.plugins (custom detectors), trainguard.ranks,
trainguard.config and the vocabulary."""
from trainguard.verdicts import RankObservation, Verdict
from trainguard.detectors.nonfinite import detect_nonfinite

__all__ = ["RankObservation", "Verdict", "detect_nonfinite"]
