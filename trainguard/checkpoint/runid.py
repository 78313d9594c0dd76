"""The run's id: written once into ``checkpoint.dir`` (the run marker) by the first start, read by every restart --
a restarted attempt that finds no marker is not in its run's directory (trainguard.checkpoint.resume) -- and the
name of the in-memory tier's folder (trainguard.checkpoint.memory_tier), hence a plain name or refused."""
from __future__ import annotations

import json
import os
import re
import uuid
from pathlib import Path

RUN_ID = ".trainguard-run"   # in checkpoint.dir: the id that names the run's snapshot folder


_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def agreed_run_id(checkpoint_dir: str | os.PathLike) -> str:
    """Every rank: rank 0's :func:`run_id`, or the same CheckpointError on every rank (none waits for the others)."""
    from trainguard.checkpoint.layout import CheckpointError
    from trainguard.ranks.isolation import broadcast_from_rank0, rank

    outcome = None
    if rank() == 0:
        try:
            outcome = (run_id(checkpoint_dir), None)
        except Exception as e:  # noqa: BLE001 - (never before the broadcast: the others wait for it)
            outcome = (None, f"{type(e).__name__}: {e}" if not isinstance(e, CheckpointError) else str(e))
    rid, error = broadcast_from_rank0(outcome)
    if error:
        raise CheckpointError(error)
    return rid


def run_id(checkpoint_dir: str | os.PathLike) -> str:
    """The run's id, created in ``checkpoint_dir`` by the first caller (rank 0) and read by the rest. The id names
    the in-memory tier's folder: one that is not a plain name (a path, ``..``) is refused by name, never followed."""
    path = Path(checkpoint_dir) / RUN_ID
    try:
        rid = json.loads(path.read_text())["id"]
    except (OSError, ValueError, KeyError, TypeError):
        rid = None
    if rid is not None:
        if not isinstance(rid, str) or not _RUN_ID.fullmatch(rid):
            from trainguard.checkpoint.layout import CheckpointError

            raise CheckpointError(f"{path} holds {rid!r}, not a run id (1-64 letters, digits, '-' or '_'): it names "
                                  "the in-memory tier's folder, so it is refused; remove the file to start a new run id")
        return rid
    from trainguard.checkpoint.fsio import atomic_write_json

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, {"id": uuid.uuid4().hex[:16]})
    return json.loads(path.read_text())["id"]
