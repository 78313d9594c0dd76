"""A snapshot shard as one message, for the copy a rank on the next node keeps (trainguard.checkpoint.snapshots'
peer copies, one concept): the committed shard packed into plain bytes, never a pickle, and unpacked there under
the commit protocol, verified before it becomes visible."""
from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

from trainguard.checkpoint.commit import STAGING_HELD, leave_staging
from trainguard.checkpoint.fsio import PRIVATE_FILE_MODE
from trainguard.checkpoint.layout import STAGING, CheckpointLayout
from trainguard.checkpoint.manifest import NOT_LISTED, list_files, verify

MAGIC = b"TGSHARD1"          # a packed shard's first bytes (SnapshotStore.pack)
MAX_HEADER = 16 << 20        # a packed shard's header: a list of file names and sizes, never this large


def pack(tag_dir: Path, tag: str) -> bytes:
    """The committed shard ``tag`` (in ``tag_dir``) as one message in a plain format, never a pickle:
    ``MAGIC``, the header's length (8 bytes, big-endian), a JSON header ``{"tag", "files": [[path, size],
    ...]}``, then every file's bytes in that order -- the manifest (and its signature) among them, so the
    copy verifies exactly as the original did."""
    rels = [*list_files(tag_dir), *_manifest_files(tag_dir)]
    blobs = [(tag_dir / rel).read_bytes() for rel in rels]
    header = json.dumps({"tag": tag, "files": [[rel, len(b)] for rel, b in zip(rels, blobs)]}).encode()
    return b"".join([MAGIC, len(header).to_bytes(8, "big"), header, *blobs])


def unpack(payload: bytes, root: Path, key: bytes | None) -> str:
    """Write a packed shard into ``root`` under the commit protocol -- staged, *verified* (its manifest,
    and with a key its signature: a copy from another node is checked like any checkpoint before it
    becomes visible), then renamed. A malformed message, a path outside the shard's folder, or a copy
    that does not verify raises ValueError and leaves nothing behind. Returns the shard's tag."""
    tag, files = _parse(payload)
    nonce = f"{tag}.{uuid.uuid4().hex[:8]}"
    staging_root = CheckpointLayout(root).staging_root(nonce)
    staged = staging_root / tag
    try:
        with STAGING_HELD:  # (.staging made and used before a commit's leave_staging may remove it)
            staged.mkdir(parents=True, exist_ok=True)
        base = staged.resolve()
        for rel, data in files:
            path = staged / rel
            if not path.resolve().is_relative_to(base):  # (inside() refused '..' already; links cannot exist yet)
                raise ValueError(f"snapshot copy of {tag}: file {rel!r} lies outside its directory")
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "xb") as f:  # (x: never through something already there)
                f.write(data)
            os.chmod(path, PRIVATE_FILE_MODE)
        res = verify(staged, key=key)
        if not res.ok:
            raise ValueError(f"snapshot copy of {tag} does not verify: {res.bad_file}: {res.reason}")
        if res.manifest.tag != tag:
            raise ValueError(f"snapshot copy of {tag} carries the manifest of {res.manifest.tag}")
        final = CheckpointLayout(root).tag_dir(tag)
        aside = root / STAGING / f"replaced.{nonce}"
        if final.exists():
            os.replace(final, aside)
        os.replace(staged, final)
        shutil.rmtree(aside, ignore_errors=True)
    finally:
        shutil.rmtree(staging_root, ignore_errors=True)
        leave_staging(root)
    return tag


def _parse(payload: bytes) -> tuple[str, list[tuple[str, memoryview]]]:
    """A packed shard's tag and files; ValueError naming what is wrong (it came over the network)."""
    from trainguard.checkpoint.layout import validate_tag
    from trainguard.checkpoint.manifest import inside

    view = memoryview(payload)
    if bytes(view[:len(MAGIC)]) != MAGIC:
        raise ValueError("not a packed snapshot shard (wrong magic bytes)")
    n = int.from_bytes(view[len(MAGIC):len(MAGIC) + 8], "big")
    start = len(MAGIC) + 8
    if n > MAX_HEADER or start + n > len(view):
        raise ValueError(f"packed shard: a header of {n} bytes does not fit the message")
    try:
        header = json.loads(bytes(view[start:start + n]).decode("utf-8"))
        tag = validate_tag(header["tag"])
        entries = [(str(rel), int(size)) for rel, size in header["files"]]
    except Exception as e:
        raise ValueError(f"packed shard: malformed header ({type(e).__name__}: {e})") from None
    offset, files = start + n, []
    for rel, size in entries:
        if not inside(rel) or size < 0 or rel.startswith("/"):
            raise ValueError(f"packed shard {tag}: file {rel!r} lies outside its directory (or a negative size)")
        files.append((rel, view[offset:offset + size]))
        offset += size
    if offset != len(view):
        raise ValueError(f"packed shard {tag}: the sizes add up to {offset} bytes, the message has {len(view)}")
    if len({rel for rel, _ in files}) != len(files):
        raise ValueError(f"packed shard {tag}: a file is listed twice")
    return tag, files


def _manifest_files(tag_dir: Path) -> list[str]:
    """The manifest (and its signature), which list_files leaves out: the copy must verify as the original."""
    return [name for name in NOT_LISTED if (tag_dir / name).is_file()]
