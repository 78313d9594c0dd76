"""A bench's figures kept under bench/results/: stamped with the date and the commit they were measured on."""
from __future__ import annotations

import datetime
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def keep(path: str | Path, figures: dict) -> None:
    """Write ``figures`` to ``path`` as JSON, after ``date``, ``commit`` (None outside a git checkout) and ``clean``
    (whether the tree had no uncommitted change to tracked files: a figure of a dirty tree is not its commit's)."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True)
    Path(path).write_text(json.dumps({"date": datetime.date.today().isoformat(),
                                      "commit": commit.stdout.strip() or None,
                                      "clean": None if dirty.returncode else not dirty.stdout.strip(), **figures},
                                     indent=1))
