"""ZeRO-aware full checkpoints on DeepSpeed's own save_checkpoint/load_checkpoint.

What a checkpoint holds: everything DeepSpeed writes (module, ZeRO-partitioned optimizer state,
scheduler, loss scaler, global/skipped steps, ``client_state``) plus, in ``<tag>/trainguard/``,
every rank's RNG states and data position (``rank<r>.pt``, loaded with ``weights_only=True``) and
the guard's state (``guard.json``); lineage and health go into ``manifest.json``.

Commit protocol (every rank takes part; rank 0 does the renames):

1. rank 0 picks a staging name; DeepSpeed writes into ``<dir>/.staging/<name>/<tag>``, each rank
   hashing and fsyncing the files it writes while it writes them;
2. each rank writes its sidecar the same way; barrier;
3. one gather of every rank's file table (rank 0 hashes anything written outside them);
4. rank 0 writes ``manifest.json`` (last), fsyncs the tree, renames the tag directory into
   ``<dir>/<tag>``, fsyncs ``<dir>``, then replaces ``latest`` atomically; barrier;
5. retention (rank 0) renames doomed checkpoints into staging before deleting them, so a crash
   never leaves a half-deleted checkpoint that still looks committed.

Resume: rank 0 verifies candidates newest first (sizes and sha256 against the manifest), falls back
past any that fail (an event names the bad file), and broadcasts the choice.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import torch

from trainguard import __version__
from trainguard.checkpoint import rng
from ds_plugins.engines import _Capture, _Hashing, _verified_loads
from trainguard.checkpoint.commit import commit_staged
from trainguard.checkpoint.layout import SIDECAR, CheckpointError, CheckpointLayout, step_tag, validate_tag
from trainguard.checkpoint.manager import CheckpointManager
from trainguard.checkpoint.manager import barrier as _barrier
from trainguard.checkpoint.manager import rank as _rank
from trainguard.checkpoint.manager import world as _world
from trainguard.checkpoint.manifest import Manifest, VerifiedReader, hash_files, list_files, manifest_digest, verify
from trainguard.checkpoint.snapshots import disk_tag, memory_tag
from trainguard.events import Record
from trainguard.guard import config_hash
from trainguard.isolation import broadcast_from_rank0 as _broadcast


def code_revision() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=os.getcwd())
        return (out.stdout.strip() or None) if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


class DeepSpeedCheckpointer(CheckpointManager):
    def __init__(self, state, base_save, base_load):
        super().__init__(state.cfg, state.guard, state.heart)
        self.state = state                     # ds_plugins.engine.EngineGuard
        self._base_save = base_save            # DeepSpeedEngine.save_checkpoint, unbound
        self._base_load = base_load
        self._pending = None                   # (BackgroundCommit, info) of an async save in flight
        self.floor = 0                         # checkpoints older than this step do not fit (precision change)
        self.failed_in_a_row = 0               # background saves that failed, in a row
        self._revision = code_revision() if _rank() == 0 else None
        from ds_plugins.snapshots import DeepSpeedShard

        self.use_memory_tier(DeepSpeedShard(self))  # (the in-memory tier, with checkpoint.snapshot.every_steps)

    @property
    def engine(self):
        return self.state.engine

    def step_count(self) -> int:
        return self.engine.global_steps

    def not_before(self, root: Path) -> int:
        return self.floor

    def after_precision_change(self) -> None:
        """The older fp16 checkpoints are no rollback targets now (they do not load into the bf16 engine)."""
        if self.cfg.dir:
            self.floor = self.engine.global_steps
        if self.snapshots is not None:
            self.snapshots.wait()
            self.snapshots.store.drop_before(self.floor)
        super().after_precision_change()

    def poll_pending(self, wait: bool = False) -> None:
        super().poll_pending(wait)
        self._poll_save(wait)

    def pending_tag(self) -> str | None:
        return self._pending[1]["tag"] if self._pending is not None else None

    # ------------------------------------------------------------------ save
    def save(self, root: str | os.PathLike, tag: str | None = None, client_state: dict | None = None) -> str:
        root = Path(root)
        self.wait_pending()  # a new save waits for the previous one
        if self.cfg.async_:
            self.heart.beat("checkpoint")
            t0 = time.perf_counter()
            tag, nonce, staging_root, cs = self._begin_save(root, tag, client_state)
            return self._save_async(root, tag, nonce, staging_root, cs, t0)
        eng = self.engine
        tag = validate_tag(tag if tag is not None else step_tag(eng.global_steps))
        cs = self._client_state(tag, client_state)

        def write(staged: Path) -> dict:
            # each rank hashes (and fsyncs) the files it writes while it writes them
            hashing = _Hashing(eng.checkpoint_engine)
            if hashing.active:
                eng.checkpoint_engine = hashing
            try:
                self._base_save(eng, str(staged.parent), tag=tag, client_state=cs, save_latest=False)
            finally:
                eng.checkpoint_engine = hashing.real
            return {os.path.relpath(p, staged): h for p, h in hashing.hashes.items()}

        return self.save_staged(root, write, tag=tag, sidecar=self._sidecar)

    def _commit(self, root: Path, tag: str, staging_root: Path, nonce: str, step: int, files: dict) -> None:
        """Rank 0, once every file is written and hashed: the commit, then retention."""
        commit_staged(root, staging_root, nonce, self._manifest(tag, step, files), key=self.key)
        self.retention(root)

    # ------------------------------------------------------------------ async save
    def _begin_save(self, root: Path, tag: str | None, client_state: dict | None):
        """Every rank: the tag, one staging name agreed from rank 0, the staging directory, and the
        client_state DeepSpeed stores (the user's, plus trainguard's own entry)."""
        eng = self.engine
        tag = validate_tag(tag if tag is not None else step_tag(eng.global_steps))
        nonce = _broadcast(f"{tag}.{uuid.uuid4().hex[:10]}")
        staging_root = CheckpointLayout(root).staging_root(nonce)
        if _rank() == 0:
            staging_root.mkdir(parents=True, exist_ok=True)
        _barrier()
        return tag, nonce, staging_root, self._client_state(tag, client_state)

    def _client_state(self, tag: str, client_state: dict | None) -> dict:
        """What DeepSpeed stores as client_state: the user's, plus trainguard's own entry."""
        cs = dict(client_state or {})
        cs["trainguard"] = {"tag": tag, "step": self.engine.global_steps, "version": __version__}
        return cs

    def _save_async(self, root: Path, tag: str, nonce: str, staging_root: Path, cs: dict, t0: float) -> str:
        from trainguard.checkpoint.async_writer import BackgroundCommit, snapshot

        eng = self.engine
        capture = _Capture(eng.checkpoint_engine, snapshot)
        original, eng.checkpoint_engine = eng.checkpoint_engine, capture
        try:
            self._base_save(eng, str(staging_root), tag=tag, client_state=cs, save_latest=False)
        finally:
            eng.checkpoint_engine = original
        staged = staging_root / tag
        writes = [(state, Path(path)) for state, path in capture.writes]
        writes.append((snapshot(self._sidecar()), staged / SIDECAR / f"rank{_rank()}.pt"))
        json_writes = []
        if _rank() == 0 and self.guard is not None:
            json_writes.append((self.guard.state_dict(), staged / SIDECAR / "guard.json"))
        step = eng.global_steps
        finish = None
        if _rank() == 0:
            def finish(table, root=root, tag=tag, staging_root=staging_root, nonce=nonce, step=step):
                self._commit(root, tag, staging_root, nonce, step, table)
        blocking = time.perf_counter() - t0
        self.state.guard.goodput.overhead(blocking)
        faults = self.state.faults
        fail = faults.write_error(step) if faults is not None else None
        self._pending = (BackgroundCommit(staged, _rank(), _world(), writes, json_writes, finish, fail=fail),
                         {"tag": tag, "dir": str(root), "step": step, "blocking_s": blocking, "t0": t0})
        self.roots[tag] = root
        self.health.saved(tag, step)
        return tag

    def _poll_save(self, wait: bool = False) -> None:
        """Report a finished background save (all of its ranks' work, on rank 0)."""
        if self._pending is None:
            return
        job, info = self._pending
        if not wait and not job.done():
            return
        self._pending = None
        try:
            job.wait()
        except Exception as e:  # noqa: BLE001 - the checkpoint stays invisible; training goes on
            self.failed_in_a_row += 1
            self.emit(info["step"], Record.CHECKPOINT_FAILED, {"tag": info["tag"], "dir": info["dir"],
                                                               "error": f"{type(e).__name__}: {e}",
                                                               "failures_in_a_row": self.failed_in_a_row})
            if self.failed_in_a_row >= 3 and _rank() == 0:  # (not forever in silence: the newest good one ages)
                import logging

                logging.getLogger("trainguard").error(
                    "trainguard: %d checkpoints in a row failed to save in the background (the last: %s: %s); the "
                    "newest committed checkpoint is getting older with every step -- check %s (space, quota, mount)",
                    self.failed_in_a_row, type(e).__name__, e, info["dir"])
            return
        self.failed_in_a_row = 0
        self.emit(info["step"], Record.CHECKPOINT_SAVED, {
            "tag": info["tag"], "dir": info["dir"], "bytes_this_rank": job.bytes, "async": True,
            "blocking_s": round(info["blocking_s"], 3), "write_s": round(job.seconds, 3),
            "total_s": round(time.perf_counter() - info["t0"], 3)})

    def _sidecar(self) -> dict:
        loader = self.state.loader
        return {"rank": _rank(), "world": _world(), "rng": rng.capture(),
                "data": loader.state_dict() if loader is not None else None,
                "data_world": loader.world if loader is not None else None}

    def _manifest(self, tag: str, step: int, files: dict) -> Manifest:
        eng = self.engine
        g = self.guard
        dtype = "fp16" if eng.fp16_enabled() else "bf16" if eng.bfloat16_enabled() else "fp32"
        last = getattr(g, "last_metrics", {}) if g is not None else {}
        import deepspeed

        return Manifest(
            tag=tag, step=step, files=files,
            layout={"world": _world(), "dp": eng.dp_world_size, "tp": 1, "pp": 1,
                    "zero_stage": eng.zero_optimization_stage(), "dtype": dtype,
                    "micro_batch_per_rank": eng.train_micro_batch_size_per_gpu(),
                    "gradient_accumulation_steps": eng.gradient_accumulation_steps()},
            lineage={"dataset_id": self.cfg.dataset_id, "dataset_version": self.cfg.dataset_version,
                     "config_hash": config_hash(self.state.cfg),
                     "versions": {"trainguard": __version__, "deepspeed": deepspeed.__version__,
                                  "torch": torch.__version__},
                     "code_revision": self._revision},
            health={"loss": last.get("loss"), "loss_median": last.get("loss_median"),
                    "skipped_steps": eng.skipped_steps, "loss_scale": last.get("loss_scale"),
                    "recent_anomalies": list(getattr(g, "recent_anomalies", []))[-10:] if g else []})

    # ------------------------------------------------------------------ load
    def load(self, root: str | os.PathLike, tag: str | None = None, mode: str = "latest_valid",
             purpose: str = "resume", **kwargs):
        """Verified load. Returns DeepSpeed's ``(path, client_state)`` or ``(None, None)``.

        ``purpose="rollback"`` (in-process): RNG comes back, but the data position, the guard's
        statistics and budgets stay as they are now -- the run moves on, it does not relive."""
        root = Path(root)
        self.heart.beat("checkpoint")
        kwargs.setdefault("load_optimizer_states", True)
        kwargs.setdefault("load_lr_scheduler_states", True)
        if tag is not None and disk_tag(tag)[1]:  # a rollback target in memory
            return self._load_snapshot(disk_tag(tag)[0], purpose, kwargs, [])
        named = tag
        tag, skipped = self.choose_for_load(root, tag, mode)
        if named is None and self.snapshots is not None and mode != "stable":  # the newest valid tier
            floor = max(self.disk_step(root, tag) + 1, self._newer_than + 1, self.floor)
            found = self.snapshots.choose(lo=floor)
            if found is not None:
                return self._load_snapshot(found[0], purpose, kwargs, skipped)
        if tag is None:
            return None, None
        man = Manifest.read(root / tag)
        saved_dp = int(man.layout.get("dp", self.engine.dp_world_size))
        load_root, universal = root, saved_dp != self.engine.dp_world_size
        if universal:
            load_root = self._universal(root, tag, man)
        eng = self.engine
        previous = eng._config.load_universal_checkpoint
        eng._config.load_universal_checkpoint = universal or previous
        try:
            reader = None if universal else VerifiedReader(root / tag, self.chosen_digest, self.key)
            with _verified_loads(eng, reader):
                path, client_state = self._base_load(eng, str(load_root), tag=tag, **kwargs)
        finally:
            eng._config.load_universal_checkpoint = previous
        if path is None:
            raise CheckpointError(f"DeepSpeed could not load checkpoint {tag} from {load_root}")
        self.state.after_load()  # e.g. the fp16 scaler object came back from the checkpoint
        self._restore_sidecars(root / tag, resharded=universal, rng_only=purpose == "rollback")
        self.roots[tag] = root
        if purpose == "rollback":
            return path, client_state
        self.resumed(root, tag, man.step, {
            "fell_back_past": skipped,
            "resharded": {"from_dp": saved_dp, "to_dp": self.engine.dp_world_size} if universal else None,
            "verified_on_load": len(reader.read_files) if reader is not None else None, "lineage": man.lineage})
        return path, client_state

    def _load_snapshot(self, tag: str, purpose: str, kwargs: dict, skipped: list):
        """Load this rank's shard of snapshot ``tag`` from node memory (after fetching it from the
        peer's copy where this node lost it), through DeepSpeed's own load_checkpoint."""
        snaps = self.snapshots
        fetched = snaps.fetch(tag)
        own = snaps.store.own
        reader = VerifiedReader(own / tag, key=self.key)  # (this rank's own shard, or the peer copy just fetched)
        with _verified_loads(self.engine, reader):
            path, client_state = self._base_load(self.engine, str(own), tag=tag, **kwargs)
        if path is None:
            raise CheckpointError(f"DeepSpeed could not load snapshot {tag} from {own}")
        self.state.after_load()
        self._restore_sidecars(own / tag, rng_only=purpose == "rollback")
        if purpose == "rollback":
            return path, client_state
        self.resumed_tag = memory_tag(tag)
        self.emit(self.engine.global_steps, Record.RESUME, {
            "tag": memory_tag(tag), "dir": str(own), "step": self.engine.global_steps, "tier": "memory",
            "from_peer_copy": fetched, "fell_back_past": skipped, "resharded": None, "verify_steps": 0,
            "verified_on_load": len(reader.read_files)})
        return path, client_state

    def _universal(self, root: Path, tag: str, man: Manifest) -> Path:
        """Another data-parallel size: convert to a DeepSpeed universal checkpoint (once, cached beside the
        checkpoint, committed by rename) and load that. The cache is keyed by the digest of the manifest rank 0
        verified -- a rollback's re-saved tag never loads the abandoned trajectory's conversion -- and is a
        checkpoint of its own: hashed, signed with the run's key, and verified before every load (its files
        are pickles too)."""
        digest = self.chosen_digest or manifest_digest(root / tag) or "unverified"
        out_root = root / ".universal" / digest[:16]
        target = out_root / tag
        if man.layout.get("zero_stage", 0) == 0:
            raise CheckpointError(f"checkpoint {tag} was saved at ZeRO-0 with dp={man.layout.get('dp')}; DeepSpeed "
                                  "can only reshard ZeRO 1-3 checkpoints (universal checkpoints); resume at the "
                                  "same data-parallel size")
        error = None
        if _rank() == 0 and not verify(target, key=self.key).ok:
            import sys

            tmp = out_root / f".{tag}.{uuid.uuid4().hex[:6]}"
            tmp.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(root / tag),
                   "--output_folder", str(tmp / tag), "--inject_missing_state"]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                error = f"ds_to_universal failed for {root / tag}:\n{res.stderr[-2000:]}"
            else:
                staged = tmp / tag
                converted = Manifest(tag=tag, step=man.step, files=hash_files(staged, list_files(staged)),
                                     layout=dict(man.layout, universal_of=digest))
                if target.exists():
                    shutil.rmtree(target)
                commit_staged(out_root, tmp, tmp.name, converted, key=self.key)
            shutil.rmtree(tmp, ignore_errors=True)
        if error is None and _rank() == 0:
            res = verify(target, key=self.key)  # (what is about to be loaded, checked now)
            if not res.ok:
                error = f"the universal conversion {target} does not verify: {res.bad_file}: {res.reason}"
        error = _broadcast(error)
        if error:
            raise CheckpointError(error)
        return out_root

    def _restore_sidecars(self, tag_dir: Path, resharded: bool = False, rng_only: bool = False) -> None:
        side = tag_dir / SIDECAR
        mine = side / f"rank{_rank()}.pt"
        loader = self.state.loader
        if not resharded and mine.exists():
            st = torch.load(mine, weights_only=True)
            if st.get("world") == _world():
                rng.restore(st["rng"])
                if not rng_only and st.get("data") is not None and loader is not None:
                    loader.load_state_dict(st["data"])
        if rng_only:
            return
        if resharded:
            # the ranks are new: RNG streams start afresh (documented); the data position is the
            # old ranks' common prefix of the epoch, split the new way; quarantines are merged
            states = [torch.load(p, weights_only=True) for p in sorted(side.glob("rank*.pt"))]
            if states and states[0].get("data") is not None and loader is not None:
                data = dict(states[0]["data"])
                data["quarantine"] = sorted({i for st in states for i in (st["data"] or {}).get("quarantine", [])})
                loader.load_state_dict(data)
        guard_file = side / "guard.json"
        if guard_file.exists() and self.guard is not None:
            self.guard.load_state_dict(json.loads(guard_file.read_text()))
