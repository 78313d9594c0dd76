"""Read the history rows back from an offline W&B run file (``run-<id>.wandb``), for the tests.

The file is a LevelDB-style log: a 7-byte header (``:W&B``, magic, version), then 32 KiB blocks of
records, each with a 7-byte header (crc32, length, type: full / first / middle / last); a
record's payload is a serialised ``wandb_internal_pb2.Record``. (wandb 0.31 no longer ships a
reader of its own.)"""
from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768
HEADER = struct.Struct("<IHB")
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str | Path) -> list[bytes]:
    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a W&B run file")
    pos, out, parts = 7, [], []
    while pos + HEADER.size <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER.size:  # block trailer padding
            pos += left
            continue
        _, length, kind = HEADER.unpack_from(data, pos)
        pos += HEADER.size
        if kind == 0 and length == 0:  # zero padding at the end of a block
            pos += left - HEADER.size
            continue
        payload = data[pos:pos + length]
        pos += length
        if kind == FULL:
            out.append(payload)
        elif kind == FIRST:
            parts = [payload]
        elif kind == MIDDLE:
            parts.append(payload)
        elif kind == LAST:
            out.append(b"".join(parts + [payload]))
            parts = []
    return out


def history(path: str | Path) -> list[dict]:
    """Every logged row, as {key: value}."""
    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    for raw in records(path):
        r = pb.Record()
        r.ParseFromString(raw)
        if r.WhichOneof("record_type") == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item})
    return rows
