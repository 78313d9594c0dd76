"""ZeRO-aware full checkpoints on DeepSpeed's own save_checkpoint/load_checkpoint.

What a checkpoint holds: everything DeepSpeed writes (module, ZeRO-partitioned optimizer state,
scheduler, loss scaler, global/skipped steps, ``client_state``) plus, in ``<tag>/trainguard/``,
every rank's RNG states and data position (``rank<r>.pt``, loaded with ``weights_only=True``) and
the guard's state (``guard.json``); lineage and health go into ``manifest.json``.

The commit protocol and the load's skeleton (verify, choose the newest valid tier, the resume record) are
the core's (trainguard.checkpoint.manager.CheckpointManager: save_staged, load); this module is DeepSpeed's
part: its save and load calls, its files hashed while written (ds_plugins.engines), the async save, the
universal conversion for another data-parallel size, and the sidecars. Every file DeepSpeed loads is read
once on the loading rank and checked against the manifest rank 0 verified (trainguard.checkpoint.verified_io).
"""
from __future__ import annotations

import fnmatch
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import torch

from trainguard import __version__, releases
from trainguard.checkpoint import rng
from ds_plugins.engines import _Capture, _Hashing
from trainguard.checkpoint.commit import commit_staged
from trainguard.checkpoint.layout import GUARD_STATE, SIDECAR, CheckpointError, CheckpointLayout, step_tag, validate_tag
from trainguard.checkpoint.manager import CheckpointManager
from trainguard.checkpoint.manager import barrier as _barrier
from trainguard.checkpoint.manager import rank as _rank
from trainguard.checkpoint.manager import world as _world
from trainguard.checkpoint.manifest import Manifest, VerifiedReader, hash_files, list_files, manifest_digest, verify
from trainguard.checkpoint.verified_io import load_weights, verified_reads
from trainguard.errors import UnsupportedSetup
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
            json_writes.append((self.guard.state_dict(), staged / SIDECAR / GUARD_STATE))
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

    # ------------------------------------------------------------------ load (the skeleton: CheckpointManager.load)
    NOTHING = (None, None)  # DeepSpeed's load_checkpoint when there is nothing to load

    def load_disk(self, root: Path, tag: str, man: Manifest, reader, purpose: str, **kwargs):
        """DeepSpeed's own load_checkpoint of ``root/tag`` -- at another data-parallel size, of its universal
        conversion -- every file DeepSpeed opens read through a verified reader. Returns ``(path, client_state)``."""
        eng = self.engine
        saved_dp = int(man.layout.get("dp", eng.dp_world_size))
        universal = saved_dp != eng.dp_world_size
        if universal:  # (refused by name on a release whose conversion loads wrong state: the support matrix)
            import deepspeed

            why = releases.feature_refusal("deepspeed", deepspeed.__version__, "reshard")
            if why is not None:
                raise UnsupportedSetup(
                    f"trainguard will not resume {root / tag} (saved at data-parallel size {saved_dp}) at size "
                    f"{eng.dp_world_size} on DeepSpeed {deepspeed.__version__}: {why}. Nothing was loaded or moved.")
        load_root, files = (self._universal(root, tag, man) if universal else (root, reader))
        previous = eng._config.load_universal_checkpoint
        eng._config.load_universal_checkpoint = universal or previous
        try:
            loaded = self._framework_load(load_root, tag, files, kwargs)
        finally:
            eng._config.load_universal_checkpoint = previous
        self._restore_sidecars(reader, root / tag, resharded=universal, rng_only=purpose == "rollback")
        resharded = {"from_dp": saved_dp, "to_dp": eng.dp_world_size, "conversion_files_verified":
                     len(files.read_files)} if universal else None
        return loaded, {"resharded": resharded}

    def load_shard(self, own: Path, tag: str, reader, purpose: str, **kwargs):
        """This rank's shard of a snapshot in node memory, through DeepSpeed's own load_checkpoint."""
        loaded = self._framework_load(own, tag, reader, kwargs)
        self._restore_sidecars(reader, own / tag, rng_only=purpose == "rollback")
        return loaded, {"rng_restored": True}

    def _framework_load(self, root: Path, tag: str, reader, kwargs: dict):
        kwargs.setdefault("load_optimizer_states", True)
        kwargs.setdefault("load_lr_scheduler_states", True)
        with verified_reads(reader):
            path, client_state = self._base_load(self.engine, str(root), tag=tag, **kwargs)
        if path is None:
            raise CheckpointError(f"DeepSpeed could not load checkpoint {tag} from {root}")
        self.state.after_load()  # e.g. the fp16 scaler object came back from the checkpoint
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
        error = pinned = None
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
            pinned = manifest_digest(target)
        error, pinned = _broadcast((error, pinned))
        if error:
            raise CheckpointError(error)
        return out_root, VerifiedReader(target, pinned, self.key)  # (each rank loads only what it checked)

    def _restore_sidecars(self, reader, tag_dir: Path, resharded: bool = False, rng_only: bool = False) -> None:
        """RNG (this rank's) and the data position from the sidecars, read through ``reader``."""
        loader = self.state.loader

        def state(rel: str) -> dict:
            return load_weights(reader, tag_dir / rel)

        mine = f"{SIDECAR}/rank{_rank()}.pt"
        if not resharded and mine in reader.files:
            st = state(mine)
            if st.get("world") == _world():
                rng.restore(st["rng"])
                if not rng_only and st.get("data") is not None and loader is not None:
                    loader.load_state_dict(st["data"])
        if rng_only or not resharded:
            return
        # the ranks are new: RNG streams start afresh (documented); the data position is the old ranks'
        # common prefix of the epoch, split the new way; quarantines are merged
        states = [state(f) for f in sorted(reader.files) if fnmatch.fnmatch(f, f"{SIDECAR}/rank*.pt")]
        if states and states[0].get("data") is not None and loader is not None:
            data = dict(states[0]["data"])
            data["quarantine"] = sorted({i for st in states for i in (st["data"] or {}).get("quarantine", [])})
            loader.load_state_dict(data)
