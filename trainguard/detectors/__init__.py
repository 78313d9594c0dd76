"""Detectors: pure functions from gathered observations to verdicts. No I/O, no collectives, no
framework imports; the policy (``trainguard.policy``) decides what to do about a verdict."""
from trainguard.verdicts import RankObservation, Verdict
from trainguard.detectors.nonfinite import detect_nonfinite

__all__ = ["RankObservation", "Verdict", "detect_nonfinite"]
