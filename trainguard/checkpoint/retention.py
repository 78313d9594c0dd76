"""Which committed checkpoints may go: never before a newer one is committed, never one of the
newest ``keep_stable`` stable ones, and always keeping the newest ``keep_last``."""
from __future__ import annotations


def to_delete(tags_oldest_first: list[str], stable: set[str], keep_last: int, keep_stable: int) -> list[str]:
    keep = set(tags_oldest_first[-keep_last:]) if keep_last > 0 else set()
    stable_order = [t for t in tags_oldest_first if t in stable]
    keep |= set(stable_order[-keep_stable:]) if keep_stable > 0 else set()
    return [t for t in tags_oldest_first if t not in keep]
