"""ZeRO-aware full checkpoints on DeepSpeed's own save_checkpoint/load_checkpoint.

What a checkpoint holds: everything DeepSpeed writes (module, ZeRO-partitioned optimizer state,
scheduler, loss scaler, global/skipped steps, ``client_state``) plus, in ``<tag>/trainguard/``,
every rank's RNG states and data position (``rank<r>.pt``, loaded with ``weights_only=True``) and
the guard's state (``guard.json``); lineage and health go into ``manifest.json``.

Commit protocol (every rank takes part; rank 0 does the renames):

1. rank 0 picks a staging name; DeepSpeed writes into ``<dir>/.staging/<name>/<tag>``;
2. each rank writes its sidecar; barrier;
3. the files are split among the ranks, each fsyncs and hashes its share; one gather;
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
import torch.distributed as dist

from trainguard import __version__
from trainguard.checkpoint import rng
from trainguard.checkpoint.fsio import atomic_write_json, fsync_dir, make_durable
from trainguard.checkpoint.health import CheckpointHealth, ResumeCheck
from trainguard.checkpoint.layout import (LATEST, SIDECAR, STABLE, STAGING, TRAJECTORY, CheckpointError,
                                          CheckpointLayout, step_tag, validate_tag)
from trainguard.checkpoint.manifest import Manifest, hash_files, list_files, verify
from trainguard.checkpoint.retention import to_delete
from trainguard.isolation import gather_objects


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _broadcast(obj):
    if not dist.is_initialized():
        return obj
    box = [obj if _rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def code_revision() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=os.getcwd())
        return (out.stdout.strip() or None) if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


class DeepSpeedCheckpointer:
    def __init__(self, state, base_save, base_load):
        self.state = state                     # ds_plugins.engine.EngineGuard
        self.cfg = state.cfg.checkpoint
        self._base_save = base_save            # DeepSpeedEngine.save_checkpoint, unbound
        self._base_load = base_load
        self.health = CheckpointHealth(self.cfg.stable_after, self.cfg.verify_steps)
        self.resume_check: ResumeCheck | None = None
        self.roots: dict[str, Path] = {}       # tag -> root it was saved under (for marks)
        self._revision = code_revision() if _rank() == 0 else None

    @property
    def engine(self):
        return self.state.engine

    @property
    def guard(self):
        return self.state.guard

    def _event(self, step: int, name: str, detail: dict, action=None) -> None:
        if self.guard is not None:
            self.guard._emit(step, name, [], action, detail)

    # ------------------------------------------------------------------ save
    def save(self, root: str | os.PathLike, tag: str | None = None, client_state: dict | None = None) -> str:
        eng = self.engine
        t0 = time.perf_counter()
        root = Path(root)
        layout = CheckpointLayout(root)
        tag = validate_tag(tag if tag is not None else step_tag(eng.global_steps))
        nonce = _broadcast(f"{tag}.{uuid.uuid4().hex[:10]}")
        staging_root = layout.staging_root(nonce)
        if _rank() == 0:
            staging_root.mkdir(parents=True, exist_ok=True)
        _barrier()
        cs = dict(client_state or {})
        cs["trainguard"] = {"tag": tag, "step": eng.global_steps, "version": __version__}
        self._base_save(eng, str(staging_root), tag=tag, client_state=cs, save_latest=False)
        staged = staging_root / tag
        side = staged / SIDECAR
        side.mkdir(parents=True, exist_ok=True)
        loader = self.state.loader
        torch.save({"rank": _rank(), "world": _world(), "rng": rng.capture(),
                    "data": loader.state_dict() if loader is not None else None,
                    "data_world": loader.world if loader is not None else None},
                   side / f"rank{_rank()}.pt")
        if _rank() == 0 and self.guard is not None:
            atomic_write_json(side / "guard.json", self.guard.state_dict())
        _barrier()

        files = list_files(staged)
        mine = files[_rank()::_world()]
        hashed = {}
        for part in gather_objects(hash_files(staged, mine)):
            hashed.update(part)
        if set(hashed) != set(files):
            raise CheckpointError(f"checkpoint {tag}: ranks hashed {len(hashed)} files, {len(files)} exist in {staged}")
        if _rank() == 0:
            make_durable(staged)
            self._manifest(tag, eng.global_steps, hashed).write(staged)
            fsync_dir(staged)
            final = layout.tag_dir(tag)
            if final.exists():  # the same tag saved again: the old one goes aside first
                os.replace(final, root / STAGING / f"replaced.{nonce}")
            os.replace(staged, final)
            fsync_dir(root)
            atomic_write_json_text(root / LATEST, tag)
            shutil.rmtree(staging_root, ignore_errors=True)
            shutil.rmtree(root / STAGING / f"replaced.{nonce}", ignore_errors=True)
            self._retention(layout)
        _barrier()
        self.roots[tag] = root
        self.health.saved(tag, eng.global_steps)
        seconds = time.perf_counter() - t0
        self._event(eng.global_steps, "checkpoint_saved", {
            "tag": tag, "dir": str(root), "files": len(hashed),
            "bytes": sum(f["size"] for f in hashed.values()), "blocking_s": round(seconds, 3),
            "total_s": round(seconds, 3)})
        return tag

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
                     "config_hash": _config_hash(self.state.cfg),
                     "versions": {"trainguard": __version__, "deepspeed": deepspeed.__version__,
                                  "torch": torch.__version__},
                     "code_revision": self._revision},
            health={"loss": last.get("loss"), "loss_median": last.get("loss_median"),
                    "skipped_steps": eng.skipped_steps, "loss_scale": last.get("loss_scale"),
                    "recent_anomalies": list(getattr(g, "recent_anomalies", []))[-10:] if g else []})

    def _retention(self, layout: CheckpointLayout) -> None:
        tags = layout.tags()
        stable = {t for t in tags if (layout.tag_dir(t) / STABLE).exists()}
        for t in to_delete(tags, stable, self.cfg.keep_last, self.cfg.keep_stable):
            trash = layout.root / STAGING / f"deleted.{t}.{uuid.uuid4().hex[:6]}"
            trash.parent.mkdir(parents=True, exist_ok=True)
            os.replace(layout.tag_dir(t), trash)   # atomic: gone from the listing at once
            shutil.rmtree(trash, ignore_errors=True)

    # ------------------------------------------------------------------ marks after a save
    def on_step_end(self, step: int, loss: float | None, anomaly: bool) -> None:
        if self.resume_check is not None:
            result = self.resume_check.on_step(step, loss)
            if result is not None:
                self._event(step, "resume_verified" if result["ok"] else "resume_discontinuity", result)
                self.resume_check = None
        for action in self.health.on_step(step, loss, anomaly):
            kind, tag = action[0], action[1]
            root = self.roots.get(tag)
            if _rank() != 0 or root is None or not (root / tag).is_dir():
                continue
            if kind == "trajectory":
                atomic_write_json(root / tag / TRAJECTORY, {"losses": {str(k): v for k, v in action[2].items()}})
            elif kind == "stable":
                atomic_write_json(root / tag / STABLE, {"stable_at_step": action[2], "stable_after": self.cfg.stable_after})
                self._event(step, "checkpoint_stable", {"tag": tag, "dir": str(root)})

    # ------------------------------------------------------------------ load
    def choose(self, root: Path, mode: str) -> tuple[str | None, list[dict]]:
        """Rank 0: the newest checkpoint that verifies (and is stable, in 'stable' mode)."""
        layout = CheckpointLayout(root)
        skipped = []
        for tag in reversed(layout.tags()):
            res = verify(layout.tag_dir(tag))
            if not res.ok:
                skipped.append({"tag": tag, "bad_file": res.bad_file, "reason": res.reason})
                continue
            if mode == "stable" and not (layout.tag_dir(tag) / STABLE).exists():
                skipped.append({"tag": tag, "reason": "not stable"})
                continue
            return tag, skipped
        return None, skipped

    def load(self, root: str | os.PathLike, tag: str | None = None, mode: str = "latest_valid", **kwargs):
        """Verified load. Returns DeepSpeed's ``(path, client_state)`` or ``(None, None)``."""
        root = Path(root)
        decision = None
        if _rank() == 0:
            if tag is not None:
                res = verify(CheckpointLayout(root).tag_dir(tag))
                decision = {"tag": tag if res.ok else None,
                            "skipped": [] if res.ok else [{"tag": tag, "bad_file": res.bad_file, "reason": res.reason}]}
            else:
                chosen, skipped = self.choose(root, mode)
                decision = {"tag": chosen, "skipped": skipped}
        decision = _broadcast(decision)
        for s in decision["skipped"]:
            if "bad_file" in s:
                self._event(self.engine.global_steps, "checkpoint_invalid", {**s, "dir": str(root)})
        if decision["tag"] is None:
            if tag is not None:
                bad = decision["skipped"][0]
                raise CheckpointError(f"checkpoint {tag} in {root} does not verify: {bad['bad_file']}: {bad['reason']}")
            return None, None
        tag = decision["tag"]
        kwargs.setdefault("load_optimizer_states", True)
        kwargs.setdefault("load_lr_scheduler_states", True)
        path, client_state = self._base_load(self.engine, str(root), tag=tag, **kwargs)
        if path is None:
            raise CheckpointError(f"DeepSpeed could not load checkpoint {tag} from {root}")
        self._restore_sidecars(root / tag)
        self.roots[tag] = root
        man = Manifest.read(root / tag)
        traj = root / tag / TRAJECTORY
        if self.cfg.verify_steps and traj.exists():
            losses = {int(k): v for k, v in json.loads(traj.read_text())["losses"].items()}
            self.resume_check = ResumeCheck(tag, losses, self.cfg.verify_rtol)
        self._event(self.engine.global_steps, "resume", {
            "tag": tag, "dir": str(root), "step": man.step, "fell_back_past": decision["skipped"],
            "lineage": man.lineage, "verify_steps": len(self.resume_check.expected) if self.resume_check else 0})
        return path, client_state

    def _restore_sidecars(self, tag_dir: Path) -> None:
        side = tag_dir / SIDECAR
        mine = side / f"rank{_rank()}.pt"
        if mine.exists():
            st = torch.load(mine, weights_only=True)
            if st.get("world") == _world():
                rng.restore(st["rng"])
                if st.get("data") is not None and self.state.loader is not None:
                    self.state.loader.load_state_dict(st["data"])
        guard_file = side / "guard.json"
        if guard_file.exists() and self.guard is not None:
            self.guard.load_state_dict(json.loads(guard_file.read_text()))


def atomic_write_json_text(path: Path, text: str) -> None:
    from trainguard.checkpoint.fsio import atomic_write_text

    atomic_write_text(path, text)


def _config_hash(cfg) -> str:
    from trainguard.guard import config_hash

    return config_hash(cfg)
