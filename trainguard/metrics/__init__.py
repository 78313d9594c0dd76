"""Metric and event sinks. The JSONL log is the source of truth; other sinks mirror it."""
from trainguard.metrics.jsonl import JsonlSink, clean

__all__ = ["JsonlSink", "clean"]
