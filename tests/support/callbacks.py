"""A user's record callback, as a block names it (``"callbacks": ["tests.support.callbacks:to_file"]``):
appends each record it gets to the file named by $TG_CALLBACK_OUT (test support only)."""
import json
import os


def to_file(record: dict) -> None:
    with open(os.environ["TG_CALLBACK_OUT"], "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
