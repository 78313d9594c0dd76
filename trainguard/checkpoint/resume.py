"""The resume at start and the choice of a checkpoint to load (the checkpoint manager's, as functions of it: ``cp``
is trainguard.checkpoint.manager.CheckpointManager). Rank 0 alone reads the listing and verifies; every rank
learns the choice. It fails closed: a directory that holds checkpoints of which none loads, or that is not the
run's own on a restarted attempt, stops the run naming each -- never a fresh start over the run's work."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from trainguard.ranks.attempt import restart_attempt
from trainguard.checkpoint.commit import restore_interrupted
from trainguard.checkpoint.layout import STABLE, STAGING, CheckpointError, CheckpointLayout, StorageError, io_entry
from trainguard.checkpoint.manifest import verify
from trainguard.checkpoint.signed import read_mark
from trainguard.checkpoint.runid import RUN_ID, agreed_run_id
from trainguard.events import Record
from trainguard.ranks.isolation import broadcast_from_rank0, rank


def choose(cp, root: Path, mode: str) -> tuple[str | None, list[dict], str | None]:
    """Rank 0: the newest checkpoint that verifies (and is stable, in 'stable' mode), what it passed over, and the
    sha256 of the manifest bytes it verified. A storage error while listing is an ``io_error`` entry: no choice."""
    try:
        return _choose(cp, root, mode)
    except (OSError, CheckpointError) as e:  # (rank 0, before the broadcast: the choice's answer, never a raise)
        return None, [io_entry(e, root)], None


def _choose(cp, root: Path, mode: str) -> tuple[str | None, list[dict], str | None]:
    layout = CheckpointLayout(root, cp.key)
    steps = layout.steps()
    skipped = layout.passed_over()
    for tag, step in reversed(steps):
        if step <= cp._newer_than:  # (older ones are older still)
            skipped.append({"tag": tag, "reason": f"not newer than step {cp._newer_than}, which the "
                            f"framework loaded from its own checkpoint", "dir": str(root)})
            break
        res = verify(layout.tag_dir(tag), key=cp.key)
        if res.io_error:  # (never passed over for a storage error: an older one loaded would set it aside)
            skipped.append({"tag": tag, "bad_file": res.bad_file, "reason": res.reason, "dir": str(root),
                            "io_error": True})
            return None, skipped, None
        if not res.ok:
            skipped.append({"tag": tag, "bad_file": res.bad_file, "reason": res.reason, "dir": str(root)})
            continue
        if mode == "stable" and not _stable(layout, tag, res.digest):
            skipped.append({"tag": tag, "reason": "not stable", "dir": str(root)})
            continue
        return tag, skipped, res.digest
    return None, skipped, None


def _stable(layout: CheckpointLayout, tag: str, digest: str | None) -> bool:
    """A stable mark the run trusts, bound (with a key) to the manifest bytes just verified."""
    mark, why = read_mark(layout.tag_dir(tag), STABLE, layout.key, digest)
    if why is not None:
        import logging

        logging.getLogger("trainguard").warning("trainguard: %s: %s", layout.tag_dir(tag), why)
    return mark is not None


def choose_for_load(cp, root: Path, tag: str | None, mode: str) -> tuple[str | None, list[dict]]:
    """Every rank: rank 0 verifies (``tag`` alone, or newest first) and everyone learns the
    choice; invalid ones passed over are reported. A named ``tag`` that fails raises."""
    decision = None
    if rank() == 0:
        if tag is not None:
            res = verify(CheckpointLayout(root).tag_dir(tag), key=cp.key)
            decision = (tag if res.ok else None,
                        [] if res.ok else [{"tag": tag, "bad_file": res.bad_file, "reason": res.reason,
                                            "dir": str(root), **({"io_error": True} if res.io_error else {})}],
                        res.digest)
        else:  # (the manifest rank 0 verified, pinned by the digest of the bytes it verified: every rank loads that)
            decision = cp.choose(root, mode)
    chosen, skipped, cp.chosen_digest = broadcast_from_rank0(decision)
    cp.last_skipped = skipped
    for s in skipped:
        if "bad_file" in s:
            cp.emit(cp.step_count(), Record.CHECKPOINT_INVALID, s)
    io = [s for s in skipped if s.get("io_error")]
    if io:  # every rank: the run stops naming the file, nothing loaded and nothing moved
        raise CheckpointError(f"checkpoint {io[0]['tag']} in {root}: {io[0]['bad_file']}: {io[0]['reason']}: the "
                              "run stops rather than pass over it (an older checkpoint loaded would set the "
                              "newest aside: a storage error must not roll progress back). Fix the storage "
                              "and restart.")
    if chosen is None and tag is not None:
        bad = skipped[0]
        raise CheckpointError(f"checkpoint {tag} in {root} does not verify: {bad['bad_file']}: {bad['reason']}")
    return chosen, skipped


def resume_on_start(cp, newer_than: int = 0) -> Any:
    """With ``checkpoint.dir``: put back a checkpoint a crash left half-replaced, clear what a
    crash left in staging, then (unless ``resume`` is "none") load the newest checkpoint that
    verifies, or the newest stable one. Returns what ``load`` returns (None when nothing was loaded).

    It fails closed: when the directory holds checkpoints and none loads, or when a
    restarted attempt finds a directory that is not its run's (no run marker: unmounted, emptied or
    mistyped), it stops with a CheckpointError naming each checkpoint and why it was refused --
    never a fresh start over the run's work, and nothing is moved when nothing was loaded. A fresh
    start over existing checkpoints is the explicit ``resume: "none"`` (they are set aside, kept).
    ``newer_than``: the step the run is at already (the framework loaded its own checkpoint, e.g.
    Megatron-LM's ``--load``): only a newer snapshot is loaded -- one state, never two -- and finding
    none is no failure. Checkpoints after the step the run goes on from belong to another trajectory:
    they are set aside (``.abandoned/``, never deleted), so that no later save replaces them under
    their tag and no later resume picks them."""
    c = cp.cfg
    if not c.dir:
        return None
    root = Path(c.dir)
    state = None
    if rank() == 0:
        existed, marked = cp._found  # (as found at construction: rank 0 with a dir always has it)
        try:
            restored = restore_interrupted(root) if root.is_dir() else []
            if (root / STAGING).is_dir():
                shutil.rmtree(root / STAGING, ignore_errors=True)  # never-committed saves
            state = (existed, marked, restored, None)
        except (OSError, CheckpointError) as e:  # (never before the broadcast: the others wait for it)
            state = (existed, marked, [], f"trainguard: checkpoint.dir {root}: {e}: nothing moved, the run stops")
    existed, marked, restored, error = broadcast_from_rank0(state)
    if error:
        raise CheckpointError(error)
    if restored:
        cp.emit(cp.step_count(), Record.CHECKPOINT_INVALID, {
            "dir": str(root), "tag": ", ".join(restored), "bad_file": STAGING,
            "reason": "a crash while the tag was saved again left it aside in staging: put back"})
    attempt = restart_attempt()
    if c.resume == "none":  # a fresh start, by choice: what is there is kept, out of the way
        set_aside = cp.abandon_after(root, -1)
        fresh_start(cp, root, existed, attempt, "checkpoint.resume is \"none\"", set_aside)
        return None
    tags = committed(root) if rank() == 0 else None
    tags = broadcast_from_rank0(tags)
    if isinstance(tags, str):  # (rank 0's storage error, raised on every rank: nothing moved)
        raise CheckpointError(tags)
    if not tags and not c.snapshot.every_steps:  # (with the in-memory tier, a run killed before its
        result = None                            # first disk checkpoint comes back from memory)
    else:
        cp._newer_than = newer_than if newer_than > 0 else -1
        cp.last_skipped = []
        try:
            result = cp.load(root, mode=c.resume)
        finally:
            cp._newer_than = -1
    if cp.resumed_tag is None and newer_than <= 0:
        if tags:
            raise CheckpointError(refusal(cp, root, tags, cp.last_skipped))
        if attempt and not marked:
            raise CheckpointError(
                f"trainguard: this is restarted attempt {attempt} of the job, and checkpoint.dir {root} "
                f"{'holds no checkpoint and no run marker (' + RUN_ID + ')' if existed else 'does not exist'}: "
                "it is not the directory the first attempt wrote to (unmounted, emptied, or another path?). "
                "Mount or correct it and restart; to start this job afresh, set checkpoint.resume to \"none\".")
        fresh_start(cp, root, existed, attempt, "no checkpoint in the directory yet", [])
        return result
    refused = [x for x in cp.last_skipped if x.get("bad_file")] if cp.resumed_tag is None else []
    if refused:  # (newer than the framework's --load, and not one verifies: a rotated key, a damaged mount)
        raise CheckpointError(
            f"trainguard: the framework loaded its own checkpoint (step {newer_than}); of the newer ones in "
            f"{root}, none can be loaded -- refused, not set aside:\n" + refusal(cp, 
                root, [x["tag"] for x in refused], cp.last_skipped))
    set_aside = cp.abandon_after(root, cp.step_count())
    if set_aside and rank() == 0:
        import logging

        logging.getLogger("trainguard").warning(
            "trainguard: the run goes on from step %d; the checkpoints after it (%s) belong to another "
            "trajectory and were moved to %s", cp.step_count(), ", ".join(set_aside), root / ".abandoned")
    if cp.resumed_tag is None and tags:  # (the framework loaded its own, newer_than: nothing newer here)
        reason = (f"the framework loaded its own checkpoint of step {newer_than}, and trainguard has none newer than "
                  f"step {newer_than} that verifies" + (" and is stable" if c.resume == "stable" else "") +
                  ": nothing to load over it, the run goes on from the framework's (not a failure)")
        cp.emit(cp.step_count(), Record.RESUME_SKIPPED, {
            "dir": str(root), "mode": c.resume, "checkpoints": tags, "reason": reason,
            "starting_at_step": cp.step_count(), "set_aside": set_aside})
    mark_run(cp, root)
    return result


def fresh_start(cp, root: Path, existed: bool, attempt: int, reason: str, set_aside: list[str]) -> None:
    """A run that starts from nothing says so, and marks the directory as its own (RUN_ID). In its first attempt it
    is a new run: an earlier run's lines in the log are set aside first (the log is this run's alone)."""
    earlier = cp.guard.new_run() if attempt == 0 and rank() == 0 and cp.guard is not None else None
    cp.emit(cp.step_count(), Record.FRESH_START, {
        "dir": str(root), "created": not existed, "attempt": attempt, "reason": reason, "set_aside": set_aside,
        **({"earlier_log": earlier} if earlier else {})})
    if rank() == 0:
        import logging

        logging.getLogger("trainguard").warning(
            "trainguard: a fresh start in %s (%s%s%s)", root, reason,
            "; the directory did not exist and is created" if not existed else "",
            f"; the log's earlier lines (another run's) moved to {earlier}" if earlier else "")
    mark_run(cp, root)


def mark_run(cp, root: Path) -> None:
    agreed_run_id(root)  # (written once: a restarted attempt that finds no marker is not in its run's dir)


def refusal(cp, root: Path, tags: list[str], skipped: list[dict]) -> str:
    why = {s["tag"]: (f"{s['bad_file']}: " if s.get("bad_file") else "") + s["reason"] for s in skipped}
    lines = [f"  {t}: {why.get(t, 'not chosen')}" for t in reversed(tags)]
    hint = ("set checkpoint.resume to \"latest_valid\" to take the newest valid one" if cp.cfg.resume == "stable"
            else "repair the cause (the key in checkpoint.hmac_key_env's variable, the mount, the files)")
    return (f"trainguard: checkpoint.dir {root} holds {len(tags)} checkpoint(s) and none can be loaded "
            f"(checkpoint.resume={cp.cfg.resume!r}); nothing was moved or deleted:\n" + "\n".join(lines) +
            f"\nTo resume, {hint}; `trainguard ckpt verify {root}` shows each one. To start afresh instead "
            "(these are then set aside in .abandoned/, kept), set checkpoint.resume to \"none\".")


def committed(root: Path) -> list[str] | str:
    """Rank 0: the checkpoints ``root`` holds, trusted or not (a resume fails closed when it holds some and none
    loads); a storage error's message instead (raised on every rank)."""
    try:
        return CheckpointLayout(root).committed()
    except OSError as e:
        return f"trainguard: checkpoint.dir {root} could not be listed ({e}): nothing moved, the run stops"


def first_resumable(roots, mode: str, key: bytes | None = None) -> tuple[Path | None, list[str]]:
    """Of checkpoint roots, newest first (a trainer's ``checkpoint-N`` folders), the first whose newest checkpoint
    verifies against its manifest -- and is stable, in "stable" mode -- with why each before it was refused; roots
    holding no checkpoint are passed over. (None, refusals): none qualifies -- the caller fails closed when some
    were refused."""
    refused = []
    for root in map(Path, roots):
        layout = CheckpointLayout(root, key)
        try:
            tags = layout.tags()
        except StorageError as e:  # (no verdict: the resume stops naming it)
            return None, [*refused, str(e)]
        refused += [f"{root.name}/{t}: {why}" for t, why in layout.unverified.items()]  # (with a key)
        if not tags:
            continue
        res = verify(layout.tag_dir(tags[-1]), key=key)
        if res.io_error:  # (a storage error is no verdict: the resume stops naming it, never an older folder)
            return None, [*refused, f"{root.name}/{tags[-1]}: {res.bad_file}: {res.reason}"]
        if not res.ok:
            refused.append(f"{root.name}/{tags[-1]}: {res.bad_file}: {res.reason}")
        elif mode == "stable" and not _stable(layout, tags[-1], res.digest):
            refused.append(f"{root.name}/{tags[-1]}: not stable")
        else:
            return root, refused
    return None, refused


def newest_resumable_folder(parent: str, mode: str, key: bytes | None = None, needed: bool = False,
                            pattern: str = r"checkpoint-(\d+)"):
    """A trainer's automatic resume (HF's Trainer: ds_plugins.auto): of ``parent``'s numbered checkpoint folders, the
    newest whose checkpoint verifies against its manifest (and is stable, in "stable" mode) -- a trainer's own
    choice is the newest by name, torn or not. Rank 0 decides, every rank learns. None: no checkpoint trainguard
    wrote is there (the trainer decides as usual). Fails closed: when trainguard's checkpoints are there
    and none qualifies -- a rotated key, a torn disk -- a CheckpointError names each and why, instead of a fresh
    start whose saves and rotation would then replace them. ``needed``: a supervised job's survivors re-entering
    the trainer after a rank died (trainguard.liveness.replacement.reentering) -- None is then an error too."""
    import os
    import re

    import torch.distributed as dist

    def choose():
        if not os.path.isdir(parent):
            return None, []
        try:  # (rank 0, before the broadcast: a storage error is a refusal, never a raise)
            found = sorted((int(m.group(1)), name) for name in os.listdir(parent)
                           if (m := re.fullmatch(pattern, name)))
            root, refused = first_resumable([os.path.join(parent, name) for _, name in reversed(found)], mode, key)
        except (OSError, CheckpointError) as e:
            return None, [str(e)]
        return (str(root) if root is not None else None), refused

    mine = choose() if not dist.is_initialized() or dist.get_rank() == 0 else None
    chosen, refused = broadcast_from_rank0(mine) if dist.is_initialized() else mine
    if chosen is None and refused:
        raise CheckpointError(
            f"trainguard: {parent} holds checkpoints trainguard wrote and none can be resumed from (checkpoint."
            f"resume={mode!r}); nothing was moved or deleted:\n  " + "\n  ".join(refused) +
            "\nRepair the cause (the key in checkpoint.hmac_key_env's variable, the files), or set "
            "checkpoint.resume to \"none\" to let your trainer decide (a fresh start, whose checkpoint rotation may "
            "then delete these).")
    if chosen is None and needed:
        from trainguard.errors import UnsupportedSetup

        raise UnsupportedSetup(f"trainguard.supervise: a rank died before the trainer saved a checkpoint trainguard "
                               f"can resume from in {parent}: the survivors have nothing to go on from in the same "
                               "processes, so the job restarts whole (torchrun --max-restarts)")
    return chosen
