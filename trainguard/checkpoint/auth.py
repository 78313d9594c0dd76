"""Authenticated checkpoints: an HMAC-SHA256 of the manifest with a key only the user holds.

The manifest lists every file's size and sha256, so its HMAC authenticates the whole checkpoint --
and it is checked *before* any file is opened: DeepSpeed's model/optimizer files are loaded with
``weights_only=False`` (pickle: code), and dist_checkpointing's ``.metadata`` is a pickle too. The
sha256 manifest alone catches rot, not tampering (whoever can change a file can rewrite the
manifest beside it); the HMAC needs the key.

``checkpoint.hmac_key_env`` names the environment variable that holds the key (never the key in the
config, which DeepSpeed copies into every checkpoint). With it, every checkpoint committed gets
``manifest.hmac``, and every checkpoint considered for a load must carry one that matches; without
it, signatures are neither written nor checked.
"""
from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

from trainguard.errors import ConfigError

SIGNATURE = "manifest.hmac"


def key_from(cfg) -> bytes | None:
    """The key named by ``cfg.hmac_key_env`` (a CheckpointConfig); a ConfigError naming the variable
    when it is configured but unset or empty -- a run that asks for authentication never runs without."""
    name = getattr(cfg, "hmac_key_env", None)
    if not name:
        return None
    key = key_in(name)
    if key is None:
        raise ConfigError([("trainguard.checkpoint.hmac_key_env",
                            f"the environment variable {name} it names is not set (or empty): set it to the key on "
                            "every rank, or remove the key to run without authenticated checkpoints")])
    if weak(key):
        raise ConfigError([("trainguard.checkpoint.hmac_key_env", weak(key, name))])
    return key


MIN_KEY_BYTES = 16  # a key that signs: at least this long (a short one is guessed by whoever can read a checkpoint)


def weak(key: bytes, name: str | None = None) -> str | None:
    """Why ``key`` is too weak to sign with (None: it is not). Checking old signatures takes any key."""
    if len(key) >= MIN_KEY_BYTES:
        return None
    return (f"the key in {name or 'the variable'} is {len(key)} bytes: a signing key needs at least {MIN_KEY_BYTES} "
            "(random bytes, e.g. `openssl rand -hex 32`); to move a run to a new key, `trainguard ckpt verify` with "
            "the old one, then `trainguard ckpt sign --force` with the new one")


def key_in(name: str) -> bytes | None:
    """The key held by the environment variable ``name``; None when it is unset or empty."""
    return os.environ.get(name, "").encode() or None


def signature(tag_dir: str | os.PathLike, key: bytes) -> str:
    from trainguard.checkpoint.layout import MANIFEST

    return signature_of((Path(tag_dir) / MANIFEST).read_bytes(), key)


def signature_of(manifest: bytes, key: bytes) -> str:
    """The HMAC-SHA256 of a manifest's bytes (hex): what ``manifest.hmac`` holds."""
    return hmac.new(key, manifest, hashlib.sha256).hexdigest()


def sign(tag_dir: str | os.PathLike, key: bytes) -> None:
    """Write ``manifest.hmac`` beside a manifest that was just written (before the commit's rename)."""
    from trainguard.checkpoint.fsio import atomic_write_text

    atomic_write_text(Path(tag_dir) / SIGNATURE, signature(tag_dir, key) + "\n")


def problem(tag_dir: str | os.PathLike, key: bytes) -> str | None:
    """None when the signature matches; else why not (reads only the manifest and its signature)."""
    import stat

    path = Path(tag_dir) / SIGNATURE
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return "manifest.hmac is not a regular file"
        stored = path.read_bytes().strip()
    except OSError:
        return "unauthenticated: no manifest.hmac (this run requires checkpoints signed with its key)"
    try:
        if not stat.S_ISREG(os.lstat(Path(tag_dir) / "manifest.json").st_mode):
            return "the manifest is not a regular file"
        expected = signature(tag_dir, key).encode()
    except OSError as e:
        return f"unreadable manifest: {e}"
    if not hmac.compare_digest(stored, expected):  # (bytes: a non-ASCII signature is a mismatch, not a TypeError)
        return "HMAC mismatch: the manifest was altered, or signed with another key"
    return None
