"""Metric and event sinks. The JSONL log is the source of truth; other sinks mirror it. ``sharedfs``: files in
folders others may write (a shared log folder, /dev/shm), opened never through a planted link.

May import trainguard.errors only."""
from trainguard.metrics.jsonl import JsonlSink, clean

__all__ = ["JsonlSink", "clean"]
