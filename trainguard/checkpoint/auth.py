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
import os
from pathlib import Path

from trainguard.errors import ConfigError

from trainguard.checkpoint.layout import SIGNATURE, signature_of  # noqa: F401 - (signature_of: this module's before)


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
            "(random bytes, e.g. `openssl rand -hex 32`); to move a run to a new key: `trainguard ckpt sign DIR "
            "--key-env NEW --old-key-env OLD` (each checkpoint verified with the old key, then signed with the new)")


def key_in(name: str) -> bytes | None:
    """The key held by the environment variable ``name``; None when it is unset or empty."""
    return os.environ.get(name, "").encode() or None


def signature(tag_dir: str | os.PathLike, key: bytes) -> str:
    from trainguard.checkpoint.layout import MANIFEST

    return signature_of((Path(tag_dir) / MANIFEST).read_bytes(), key)


def sign(tag_dir: str | os.PathLike, key: bytes) -> None:
    """Write ``manifest.hmac`` beside a manifest that was just written (before the commit's rename)."""
    from trainguard.checkpoint.fsio import atomic_write_text

    atomic_write_text(Path(tag_dir) / SIGNATURE, signature(tag_dir, key) + "\n")


def problem(tag_dir: str | os.PathLike, key: bytes) -> str | None:
    """None when the signature matches; else why not (reads the manifest and its signature once each, never through
    a link). A storage error raises (trainguard.checkpoint.layout.StorageError): it is no verdict."""
    from trainguard.checkpoint.layout import read_manifest

    return read_manifest(tag_dir, key).why


def sign_verified(tag_dir: str | os.PathLike, key: bytes, digest: str) -> None:
    """Sign the manifest bytes whose sha256 is ``digest`` -- those just verified -- and nothing else: a manifest
    changed since is refused (a CheckpointError), never signed."""
    from trainguard.checkpoint.fsio import atomic_write_text
    from trainguard.checkpoint.layout import MANIFEST, CheckpointError, read_regular

    raw = read_regular(Path(tag_dir) / MANIFEST)
    if hashlib.sha256(raw).hexdigest() != digest:
        raise CheckpointError(f"{Path(tag_dir) / MANIFEST} changed since it was verified: not signed")
    atomic_write_text(Path(tag_dir) / SIGNATURE, signature_of(raw, key) + "\n")
