"""Checkpoints that can always be trusted (framework-free part).

A checkpoint is a directory ``<dir>/<tag>`` that counts only once its ``manifest.json`` exists and
every file it lists matches its recorded size and sha256. The commit protocol (``commit.py``)
writes everything into ``<dir>/.staging/...``, makes it durable, writes the manifest last, renames
the directory into place, and only then moves the ``latest`` pointer; so a crash at any moment
leaves either the previous checkpoint or the new one visible, never a torn one.

May import trainguard.data (the data position it stores), trainguard.protocols, trainguard.ranks, trainguard.config
and the vocabulary -- no room of the step, of recovery or of liveness: those use checkpoints, never the reverse.
"""
from trainguard.checkpoint.layout import CheckpointLayout, validate_tag
from trainguard.checkpoint.manifest import Manifest, VerifyResult, verify

__all__ = ["CheckpointLayout", "validate_tag", "Manifest", "VerifyResult", "verify"]
