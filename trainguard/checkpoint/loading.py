"""Loading a chosen checkpoint, for every adapter (the checkpoint manager's, as functions of it: ``cp`` is
trainguard.checkpoint.manager.CheckpointManager): the newest valid tier, each rank reading only bytes it checked
against the manifest rank 0 verified; the framework's state through the adapter's State (through a converted
copy where it needs one: trainguard.checkpoint.conversion); then the sidecars -- RNG, the framework's part, the
data position (merged across the old ranks when resharded) -- and, on a resume, the guard's state and the
``resume`` record."""
from __future__ import annotations

import fnmatch
import json
from pathlib import Path
from typing import Any

import torch

from trainguard.checkpoint import rng
from trainguard.checkpoint.health import ResumeCheck
from trainguard.checkpoint.layout import GUARD_STATE, SIDECAR, TRAJECTORY, CheckpointLayout
from trainguard.checkpoint.manifest import Manifest
from trainguard.checkpoint.signed import read_mark
from trainguard.checkpoint.reader import VerifiedReader
from trainguard.checkpoint.snapshots import disk_tag, memory_tag
from trainguard.checkpoint.verified_io import load_weights
from trainguard.data.position import merge_positions
from trainguard.events import Record
from trainguard.ranks.isolation import rank, world


@torch.no_grad()  # (a load writes into parameters and their views: Megatron's distributed optimizer over fp32
# weights copies into views of them, which autograd refuses in a rollback taken mid-training -- the run aborted)
def load(cp, root, tag: str | None = None, mode: str = "latest_valid", purpose: str = "resume", **kwargs):
    """Every rank: load ``tag`` (a disk tag, or ``memory:<tag>`` from :meth:`rollback_target`), or the newest
    valid tier -- the newest checkpoint that verifies (and is stable, with ``mode="stable"``), unless a snapshot
    in node memory is newer. Each rank reads only bytes it checked against the manifest rank 0 verified
    (:class:`VerifiedReader`; the adapter routes its framework's reads through it). ``purpose="rollback"``
    (in-process): the framework's state and RNG come back, the guard's statistics and budgets stay as they are
    now -- the run moves on, it does not relive. Returns what the adapter's load returns, or ``NOTHING``."""
    cp.wait_pending()  # (a save still being written in the background is committed first: it may be the one asked for)
    root = Path(root)
    cp.heart.beat("checkpoint")
    if tag is not None and disk_tag(tag)[1]:  # a rollback target in memory
        return load_memory(cp, disk_tag(tag)[0], purpose, [], kwargs)
    chosen, skipped = cp.choose_for_load(root, tag, mode)
    tag_dir = CheckpointLayout(root).tag_dir(chosen) if chosen is not None else None
    # (every rank: the manifest pinned to the bytes rank 0 verified, read once -- its step, layout, files)
    reader = VerifiedReader(tag_dir, cp.chosen_digest, cp.key) if tag_dir is not None else None
    if tag is None and cp.snapshots is not None and mode != "stable":  # the newest valid tier
        found = cp.snapshots.choose(lo=max((reader.manifest.step if reader else -1) + 1, cp._newer_than + 1,
                                             cp.not_before(root)))
        if found is not None:
            return load_memory(cp, found[0], purpose, skipped, kwargs)
    if chosen is None:
        return cp.NOTHING
    man = reader.manifest
    result, detail = load_disk(cp, root, chosen, man, reader, purpose, **kwargs)
    cp.roots[chosen] = root
    if purpose == "rollback":
        return result
    load_guard_state(cp, reader, tag_dir)
    resumed(cp, root, chosen, man.step, reader.digest, {"fell_back_past": skipped, **detail,
                                          "verified_on_load": len(reader.read_files), "lineage": man.lineage},
            asked=tag)
    return result


def load_memory(cp, tag: str, purpose: str, skipped: list, kwargs: dict):
    """This rank's shard of snapshot ``tag`` from node memory (fetched first from the peer's copy where this
    node lost it), its bytes checked against its manifest (and signature) on this rank."""
    fetched = cp.snapshots.fetch(tag)
    own = cp.snapshots.store.own
    reader = VerifiedReader(own / tag, key=cp.key)
    result, detail = load_shard(cp, own, tag, reader, purpose, **kwargs)
    if purpose == "rollback":
        return result
    load_guard_state(cp, reader, own / tag)
    cp.resumed_tag = memory_tag(tag)
    cp.emit(cp.step_count(), Record.RESUME, ranks=list(range(world())), detail={**said(cp, own),
        "tag": memory_tag(tag), "dir": str(own), "step": cp.step_count(), "tier": "memory",
        "from_peer_copy": fetched, "fell_back_past": skipped, "resharded": None, "verify_steps": 0, **detail,
        "verified_on_load": len(reader.read_files)})
    cp.on_resume(cp.guard, cp.step_count())
    return result


def load_guard_state(cp, reader: VerifiedReader, tag_dir: Path) -> None:
    """The guard's statistics, budgets and quarantine as saved (a resume, not a rollback)."""
    if cp.guard is not None and f"{SIDECAR}/{GUARD_STATE}" in reader.files:
        cp.guard.load_state_dict(json.loads(reader.read(tag_dir / SIDECAR / GUARD_STATE)))


def load_disk(cp, root: Path, tag: str, man: Manifest, reader: VerifiedReader, purpose: str,
              **kwargs) -> tuple[Any, dict]:
    """Every rank: the framework's state of ``root/tag`` (through its conversion where the adapter needs one:
    trainguard.checkpoint.conversion), then the sidecars; every byte read through a verified reader."""
    state = cp.state
    converted = state.conversion(man)
    load_root, files = root, reader
    if converted:
        from trainguard.checkpoint.conversion import converted as conversion

        digest = cp.chosen_digest or reader.digest
        load_root, files = conversion(cp, root, tag, man, digest, reader)
    result, detail = state.load(load_root, tag, man, files, purpose, converted=converted, **kwargs)
    now = state.layout()
    same = not converted and all(man.layout.get(k) == now.get(k) for k in ("world", "tp", "pp", "dp"))
    data, restored = restore_sidecars(cp, reader, root / tag, same, purpose)
    if purpose != "rollback":
        result = state.use_data(data, result)
    resharded = None if same else {"from": man.layout, "to": now, "from_dp": man.layout.get("dp"),
                                   "to_dp": now.get("dp"),
                                   **({"conversion_files_verified": len(files.read_files)} if converted else {})}
    return result, {"rng_restored": restored, "resharded": resharded, **detail}


def load_shard(cp, own: Path, tag: str, reader: VerifiedReader, purpose: str, **kwargs) -> tuple[Any, dict]:
    """Every rank: this rank's shard ``own/tag`` of the in-memory tier, then its sidecar."""
    result, detail = cp.state.load_shard(own, tag, reader, purpose, **kwargs)
    data, restored = restore_sidecars(cp, reader, own / tag, True, purpose)
    if purpose != "rollback":
        result = cp.state.use_data(data, result)
    return result, {"rng_restored": restored, **detail}


def restore_sidecars(cp, reader: VerifiedReader, tag_dir: Path, same: bool, purpose: str) -> tuple[Any, bool]:
    """This rank's RNG and the framework's part of its sidecar, when the ranks are the ones that wrote them
    (``same``); returns (the data position, whether the RNG came back). Resharded, the ranks are new: RNG streams
    start afresh (documented) and the data position is the old ranks' common one, merged (trainguard.data)."""
    def side(rel: str) -> dict:
        return load_weights(reader, tag_dir / rel)

    mine = f"{SIDECAR}/rank{rank()}.pt"
    if same:
        if mine not in reader.files:
            return None, False
        st = side(mine)
        if st.get("world", world()) != world():
            return None, False
        rng.restore(st["rng"])
        cp.state.restore_sidecar(st)
        return _data_of(st), True
    if purpose == "rollback":
        return None, False
    names = sorted((f for f in reader.files if fnmatch.fnmatch(f, f"{SIDECAR}/rank*.pt")),
                   key=lambda f: int(f[len(SIDECAR) + 5:-3]) if f[len(SIDECAR) + 5:-3].isdigit() else 1 << 30)
    return merge_positions([_data_of(side(f)) for f in names]), False


def resumed(cp, root: Path, tag: str, step: int, digest: str, detail: dict, asked: str | None = None) -> None:
    """After a resume's load (not a rollback's): the resume cp-test armed and the ``resume`` record (``asked``: the
    tag the framework's load named)."""
    cp.roots[tag] = root
    cp.resumed_tag = tag
    start_resume_check(cp, tag, root / tag, digest)
    cp.emit(cp.step_count(), Record.RESUME, ranks=list(range(world())), detail={**said(cp, root, asked),
        "tag": tag, "dir": str(root), "step": step, "tier": "disk", **detail,
        "verify_steps": len(cp.resume_check.expected) if cp.resume_check else 0})
    cp.on_resume(cp.guard, cp.step_count())  # (a rank's replacement that re-entered this run: trainguard.liveness.replacement)


def said(cp, where: Path, asked: str | None = None) -> dict:
    """Why a resume happened and how to turn it off (the console says it: a resume the user's script did not ask
    for -- HF's ``resume_from_checkpoint=None`` -- is trainguard's, and must not be silent). ``asked``: the tag a
    load of the framework's named (Accelerate's ``load_state``, your ``load_checkpoint(dir, tag)``): that one, not
    trainguard's choice -- said so (a new user read the rule's line as trainguard overriding their load)."""
    if asked is not None:
        return {"why": f"the framework's load asked for checkpoint {asked} of {where}: loaded once it verified",
                "advice": "checkpoint.resume is trainguard's own choice at a start; it does not change a load you ask for"}
    return {"why": f"checkpoint.resume: \"{cp.cfg.resume}\" -- trainguard loads the newest checkpoint that verifies, "
                   f"newer than the step the run was at, from {where}",
            "advice": "to start fresh instead: checkpoint.resume: \"none\" (or another checkpoint.dir)"}


def start_resume_check(cp, tag: str, tag_dir: Path, digest: str) -> None:
    """The post-save trajectory (a mark bound to the manifest loaded; with a key, signed) armed as the resume's
    self-test; one unsigned, altered or malformed is ignored, said in the log -- never a crash of the restart."""
    if not cp.cfg.verify_steps:
        return
    mark, why = read_mark(tag_dir, TRAJECTORY, cp.key, digest)
    try:
        losses = {int(k): None if v is None else float(v) for k, v in mark["losses"].items()} if mark else None
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        losses, why = None, f"{TRAJECTORY}: malformed ({type(e).__name__}: {e}): ignored"
    if why is not None:
        import logging

        logging.getLogger("trainguard").warning("trainguard: %s: %s; the resume is not self-tested", tag_dir, why)
    if losses:
        cp.resume_check = ResumeCheck(tag, losses, cp.cfg.verify_rtol)


def _data_of(side: dict) -> Any:
    """A sidecar's data position (``data``; megatron's older sidecars: ``data_state``)."""
    return side.get("data", side.get("data_state"))
