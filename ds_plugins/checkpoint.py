"""DeepSpeed's state as trainguard's checkpoint manager saves and loads it (trainguard.protocols.State).

What a checkpoint holds: everything DeepSpeed writes (module, ZeRO-partitioned optimizer state, scheduler, loss
scaler, global/skipped steps, ``client_state``) plus trainguard's sidecars and manifest. The protocol -- staging,
hashes, manifest, signature, commit, async saves, the universal conversion's cache, the sidecars -- is the core's
(trainguard.checkpoint.manager.CheckpointManager); this module is DeepSpeed's calls only: its save (each file hashed
as written: ds_plugins.engines) or host copies of it (async), its load through a verified reader, its universal
conversion for another data-parallel size, and its data loader's position.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ds_plugins.engines import _Capture, _Hashing
from ds_plugins.facts import _dtype
from ds_plugins.snapshots import DeepSpeedShard, _estimated_shard_bytes
from trainguard.ports import CheckpointError, CORE_VERSION, host_copy, releases, verified_reads, world
from trainguard.errors import UnsupportedSetup


class DeepSpeedState:
    """trainguard.protocols.State over one DeepSpeed engine (``state``: ds_plugins.engine.EngineGuard)."""

    name = "deepspeed"
    format = None
    nothing = (None, None)  # DeepSpeed's load_checkpoint when there is nothing to load

    def __init__(self, state, base_save, base_load):
        self.guarded = state
        self._base_save = base_save  # DeepSpeedEngine.save_checkpoint, unbound
        self._base_load = base_load

    @property
    def engine(self):
        return self.guarded.engine

    def step(self) -> int:
        return self.engine.global_steps

    def layout(self) -> dict:
        eng = self.engine
        return {"world": world(), "dp": eng.dp_world_size, "tp": 1, "pp": 1, "precision": _dtype(eng),
                "zero_stage": eng.zero_optimization_stage(),
                "micro_batch_per_rank": eng.train_micro_batch_size_per_gpu(),
                "gradient_accumulation_steps": eng.gradient_accumulation_steps()}

    def versions(self) -> dict:
        import deepspeed

        return {"deepspeed": deepspeed.__version__}

    def health(self) -> dict:
        return {"skipped_steps": self.engine.skipped_steps}

    def precision_bound(self) -> bool:
        return True  # (an fp16 checkpoint does not load into the bf16 engine, nor the other way)

    # ------------------------------------------------------------------ save
    def _client_state(self, tag: str, client_state: dict | None) -> dict:
        cs = dict(client_state or {})
        cs["trainguard"] = {"tag": tag, "step": self.engine.global_steps, "version": CORE_VERSION}
        return cs

    def write(self, staged: Path, tag: str, client_state: dict | None = None) -> dict:
        """DeepSpeed's own save into the staging folder, each file hashed (and fsynced) as it is written."""
        eng = self.engine
        hashing = _Hashing(eng.checkpoint_engine)
        if hashing.active:
            eng.checkpoint_engine = hashing
        try:
            self._base_save(eng, str(staged.parent), tag=tag, client_state=self._client_state(tag, client_state),
                            save_latest=False)
        finally:
            eng.checkpoint_engine = hashing.real
        return {os.path.relpath(p, staged): h for p, h in hashing.hashes.items()}

    def host_bytes(self, local: bool = False) -> int:  # (about what capture copies: trainguard.checkpoint.hostroom)
        return _estimated_shard_bytes(self.engine)

    def capture(self, staging_root: Path, tag: str, client_state: dict | None = None) -> list:
        """An async save's blocking part: DeepSpeed's save with its checkpoint engine capturing host copies."""
        eng = self.engine
        capture = _Capture(eng.checkpoint_engine, host_copy)
        original, eng.checkpoint_engine = eng.checkpoint_engine, capture
        try:
            self._base_save(eng, str(staging_root), tag=tag, client_state=self._client_state(tag, client_state),
                            save_latest=False)
        finally:
            eng.checkpoint_engine = original
        return capture.writes

    def sidecar(self, **_) -> dict:
        loader = self.guarded.loader
        return {"data": loader.state_dict() if loader is not None else None,
                "data_world": loader.world if loader is not None else None}

    def restore_sidecar(self, side: dict) -> None:
        return None  # (DeepSpeed keeps no RNG of its own)

    def use_data(self, data, result):
        loader = self.guarded.loader
        if data is not None and loader is not None:
            loader.load_state_dict(data)
        return result

    # ------------------------------------------------------------------ load
    def conversion(self, man) -> bool:
        """Another data-parallel size loads through DeepSpeed's universal checkpoint (ZeRO 1-3 only), refused by name
        on a release whose conversion loads wrong state (the support matrix)."""
        eng = self.engine
        saved_dp = int(man.layout.get("dp", eng.dp_world_size))
        if saved_dp == eng.dp_world_size:
            return False
        import deepspeed

        why = releases.feature_refusal("deepspeed", deepspeed.__version__, "reshard")
        if why is not None:
            raise UnsupportedSetup(
                f"trainguard will not resume {man.tag} (saved at data-parallel size {saved_dp}) at size "
                f"{eng.dp_world_size} on DeepSpeed {deepspeed.__version__}: {why}. Nothing was loaded or moved.")
        if man.layout.get("zero_stage", 0) == 0:
            raise CheckpointError(f"checkpoint {man.tag} was saved at ZeRO-0 with dp={saved_dp}; DeepSpeed can only "
                                  "reshard ZeRO 1-3 checkpoints (universal checkpoints); resume at the same "
                                  "data-parallel size")
        return True

    def convert(self, source: Path, out: Path) -> str | None:
        cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(source),
               "--output_folder", str(out), "--inject_missing_state"]
        res = subprocess.run(cmd, capture_output=True, text=True, cwd=source.parent)  # (private: never the job's cwd)
        return None if res.returncode == 0 else f"ds_to_universal: {res.stderr}"

    def load(self, root: Path, tag: str, man, reader, purpose: str, converted: bool = False, **kwargs):
        """DeepSpeed's own load_checkpoint of ``root/tag`` (a universal conversion when ``converted``), every file it
        opens read through ``reader``. Returns ``(path, client_state)``."""
        eng = self.engine
        previous = eng._config.load_universal_checkpoint
        eng._config.load_universal_checkpoint = converted or previous
        try:
            return self._framework_load(root, tag, reader, kwargs), {}
        finally:
            eng._config.load_universal_checkpoint = previous

    def load_shard(self, own: Path, tag: str, reader, purpose: str, **kwargs):
        """This rank's shard of a snapshot in node memory, through DeepSpeed's own load_checkpoint."""
        return self._framework_load(own, tag, reader, kwargs), {}

    def _framework_load(self, root: Path, tag: str, reader, kwargs: dict):
        kwargs.setdefault("load_optimizer_states", True)
        kwargs.setdefault("load_lr_scheduler_states", True)
        with verified_reads(reader):
            path, client_state = self._base_load(self.engine, str(root), tag=tag, **kwargs)
        if path is None:
            raise CheckpointError(f"DeepSpeed could not load checkpoint {tag} from {root}")
        self.guarded.after_load()  # e.g. the fp16 scaler object came back from the checkpoint
        return path, client_state

    def shard_source(self):
        return DeepSpeedShard(self)
