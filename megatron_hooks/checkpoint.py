"""megatron-core's state as trainguard's checkpoint manager saves and loads it (trainguard.protocols.State):
full snapshots through ``megatron.core.dist_checkpointing``, committed by the core's protocol, with the same
manifest and layout as every adapter's (trainguard.checkpoint).

    ckpt = guard.checkpointer                      # megatron_hooks.install(...) made it
    ckpt.save("ckpt", data_state={"consumed": n})  # every rank; returns the tag
    state = ckpt.load("ckpt")                      # every rank: the newest that verifies; your data_state

A snapshot holds: the sharded model and optimizer state (``sharded_state_dict`` of each model chunk and of the
optimizer, written by dist_checkpointing's own writer), and per rank a sidecar with every RNG *and megatron's
tensor-parallel RNG tracker states*, the iteration and your ``data_state``; rank 0 adds the guard's state. The
commit and the verified load are the core's (trainguard.checkpoint): dist_checkpointing deserialises only bytes
checked against the manifest. It reshards on load (a TP=2 snapshot loads into TP=1; the RNG sidecars then do not
map rank to rank and are skipped: the resume event says so).
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from trainguard.ports import by_turns, CheckpointError, hashed_writes, STAGING, verified_reads
from trainguard.events import Record
from megatron_hooks.parts import _dtype, _optimizers, _unwrap
from megatron_hooks.snapshots import OWN_STATE_LAYOUT, SHARD, MegatronShard

OPTIMIZER_FORMAT = "dp_reshardable"  # the distributed optimizer's on-disk sharding (see _sharded)
DIST = "dist"                        # dist_checkpointing's folder inside a tag
CONFIG = "metadata.json"             # dist_checkpointing's config file in it (its backend and format)


def finish_framework_async_saves() -> None:
    """Megatron-LM's asynchronous save in flight is finalised first: every dist_checkpointing save of a process hands
    its write results through one queue (filesystem_async's), and a snapshot saved meanwhile swapped results with it
    (Megatron-LM's checkpoint then unreadable: docs/megatron.md). Its queue is the same on every rank."""
    lm = __import__("sys").modules.get("megatron.training.async_utils")
    if lm is not None and not lm.is_empty_async_queue():
        lm.maybe_finalize_async_save(blocking=True)


class MegatronState:
    """trainguard.protocols.State over megatron-core model chunks and optimizer (``mg``: megatron_hooks.MegatronGuard)."""

    name = "megatron-core"
    format = "megatron dist_checkpointing"
    nothing = None

    def __init__(self, mg):
        self.mg = mg

    def step(self) -> int:
        return self.mg.iteration

    # ------------------------------------------------------------------ state
    def _sharded(self, is_loading: bool = False) -> dict:
        """The sharded state of the model chunks and the optimizer. The distributed optimizer's
        state is written ``dp_reshardable`` (Megatron-LM's default: each rank its own shard, no
        gather; a resume may change the data-parallel size only). megatron-core 0.16's own default
        (fully_sharded_model_space) fails its own checks, and ``fully_reshardable`` does not load
        over torch's Adam (without apex/TE)."""
        model_sd, sd = {}, {}
        for i, chunk in enumerate(self.mg.chunks):
            model_sd.update(sd.setdefault(f"model{i}" if len(self.mg.chunks) > 1 else "model",
                                          _unwrap(chunk).sharded_state_dict()))
        sd["optimizer"] = self.mg.optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, metadata={"distrib_optim_sharding_type": OPTIMIZER_FORMAT})
        return sd

    def layout(self) -> dict:
        from megatron.core import parallel_state as ps

        return {"world": dist.get_world_size(), "tp": ps.get_tensor_model_parallel_world_size(),
                "pp": ps.get_pipeline_model_parallel_world_size(), "dp": ps.get_data_parallel_world_size(),
                "ep": ps.get_expert_model_parallel_world_size(), "chunks": len(self.mg.chunks),
                "precision": _dtype(self.mg.chunks[0]), "distributed_optimizer": _distributed(self.mg.optimizer),
                **({"optimizer_state": "empty"} if _stateless(self.mg.optimizer) else {})}

    def versions(self) -> dict:
        import megatron.core

        return {"megatron-core": getattr(megatron.core, "__version__", None)}

    def health(self) -> dict:
        return {"skipped_steps": self.mg.guard.skipped_steps}

    def precision_bound(self) -> bool:
        """With the distributed optimizer, snapshots of another precision do not load (its on-disk layout names the
        buffers by dtype). (megatron's own fp16 optimizer loads either.)"""
        return _distributed(self.mg.optimizer)

    def _match_precision(self, saved: str | None, now: str, tag: str) -> None:
        """A bf16 snapshot (written after the ladder's bf16 fallback) loaded by a run launched in
        fp16: the run is turned into bf16 first, as it was when the snapshot was written -- a restart
        does not bring the fp16 trouble back."""
        if saved == "bf16" and now == "fp16":
            detail = self.mg.session.to_bf16(self.mg.iteration)
            self.mg.session.emit(self.mg.iteration, Record.PRECISION_FALLBACK, action="bf16_fallback", detail={
                **detail, "reason": f"snapshot {tag} was written in bf16 (after a bf16 fallback)"})

    def _main_params_to_model(self, loaded_precision=None, now=None) -> None:
        """After a load: the model parameters from the exact fp32 main parameters, as the optimizer's step writes
        them -- after a snapshot of another precision (fp16 into a bf16 run), and always under the distributed
        optimizer, each rank's region then gathered from the replicas: with --overlap-param-gather the weights'
        all-gather waits for the next forward, so a snapshot taken after a step holds the other replicas' regions a
        step old (the main values are the step's own; a rollback re-ran from mixed weights)."""
        distributed = _distributed(self.mg.optimizer)
        if loaded_precision in (None, now) and not distributed:
            return
        for o in _optimizers(self.mg.optimizer):
            if hasattr(o, "_copy_main_params_to_model_params"):
                o._copy_main_params_to_model_params()
        for chunk in (c for c in self.mg.chunks if distributed and hasattr(c, "start_param_sync")):
            chunk.start_param_sync(force_sync=True)  # (every rank loads together: a collective is safe here)

    # ------------------------------------------------------------------ save
    def write(self, staged: Path, tag: str, data_state: dict | None = None) -> dict:
        """dist_checkpointing's save into the staging folder, each file this rank's writers produce (its threads,
        or on megatron-core 0.16 its forked processes; torch DCP's pickled ``.metadata``; its ``metadata.json``)
        hashed from the bytes as written (trainguard.checkpoint.write_hashes)."""
        from megatron.core import dist_checkpointing

        if dist.get_rank() == 0:
            (staged / DIST).mkdir()
        finish_framework_async_saves()
        dist.barrier()
        with hashed_writes(staged) as hashes:
            dist_checkpointing.save(self._sharded(), str(staged / DIST))
        return hashes.table

    def capture(self, staging_root: Path, tag: str, **_) -> None:
        return None  # (dist_checkpointing's save is a collective: no host-copy async save here)

    def host_bytes(self, local: bool = False) -> int | None:  # (what capture_local copies; None: nothing)
        return MegatronShard(self, once=True).estimated_bytes() if local else None

    def capture_local(self, staging_root: Path, tag: str) -> list | None:
        """The first step's insurance in the background: this rank's state as the memory tier takes it (no collective;
        loads at this layout only, by this run's restart -- :meth:`load` tells it by its files) -- what data-parallel
        replicas share (the weights; the optimizer, where it is not distributed) written once, by the first of them."""
        return MegatronShard(self, once=True).capture(staging_root, tag, self.step())

    def sidecar(self, data_state: dict | None = None) -> dict:
        """Megatron's tensor-parallel RNG tracker, the iteration and the user's data position (``data_state``;
        default: what ``install(data_state=...)`` returns)."""
        from megatron.core import tensor_parallel

        mg = self.mg
        if data_state is None and mg.data_state is not None:
            data_state = mg.data_state()
        return {"tracker": tensor_parallel.get_cuda_rng_tracker().get_states(), "iteration": mg.iteration,
                "data": data_state}

    def restore_sidecar(self, side: dict) -> None:
        from megatron.core import tensor_parallel

        tensor_parallel.get_cuda_rng_tracker().set_states(side["tracker"])
        if "iteration" in side:
            self.mg.iteration = int(side["iteration"])

    def use_data(self, data, result):
        return data  # (load returns the data position: the user's loop puts it back)

    # ------------------------------------------------------------------ load
    def conversion(self, man) -> bool:
        """dist_checkpointing reshards on load, without a converted copy; with the distributed optimizer only the
        data-parallel size may change, and an fp16 snapshot does not load into a bf16 run."""
        now = self.layout()
        tag = man.tag
        if (man.layout.get("distributed_optimizer") or now["distributed_optimizer"]) and \
                any(man.layout.get(k) != now[k] for k in ("tp", "pp")):
            raise CheckpointError(
                f"snapshot {tag} was written at TP={man.layout.get('tp')}, PP={man.layout.get('pp')} "
                f"and this run is TP={now['tp']}, PP={now['pp']}: with the distributed optimizer (state written "
                f"{OPTIMIZER_FORMAT}) only the data-parallel size may change between save and load")
        if man.layout.get("distributed_optimizer") and now["distributed_optimizer"] and \
                man.layout.get("precision") == "fp16" and now["precision"] == "bf16":
            raise CheckpointError(
                f"snapshot {tag} was written in fp16 with the distributed optimizer, and this run is "
                f"bf16: its on-disk layout ({OPTIMIZER_FORMAT}) names the buffers by dtype, so it loads into an fp16 "
                "run only -- relaunch in fp16 (the loss_scale ladder can turn it into bf16 again)")
        return False

    def convert(self, source: Path, out: Path) -> str | None:
        return "megatron-core checkpoints need no conversion"

    def load(self, root: Path, tag: str, man, reader, purpose: str, converted: bool = False, **kwargs):
        """dist_checkpointing's load of ``root/tag`` (it reshards across TP/PP/DP where the optimizer allows),
        every file it opens read through ``reader``."""
        from megatron.core import dist_checkpointing

        mg, tag_dir, now = self.mg, root / tag, self.layout()
        local = any(f.startswith(f"{SHARD}/") for f in reader.files)  # (the first step's, each rank's own state)
        if local:
            _same_layout(tag_dir, man.layout, now)  # (before the precision follows it: a refused load changes nothing)
        self._match_precision(man.layout.get("precision"), now["precision"], tag)
        if local:  # (each rank's own state; the replicas read the first one's weights: by turns where a node must)
            shard = MegatronShard(self, once=True)
            by_turns(2 * shard.read_bytes(reader), lambda: shard.load(reader, tag_dir))
            return self._loaded(man, now)
        fresh = man.layout.get("optimizer_state") == "empty"  # (written before any update: _stateless)
        moments = [(o.optimizer.state, dict(o.optimizer.state)) for o in _optimizers(mg.optimizer) if fresh]
        try:
            for o in _optimizers(mg.optimizer):
                if fresh:
                    o.optimizer.state.clear()
                elif _distributed(o) and not o.optimizer.state:  # (before its first step: nothing to load into,
                    o._init_optimizer_states_with_dummy_values()  # nor apex/TE to describe it: megatron's own dummies)
            if f"{DIST}/{CONFIG}" in reader.files:  # (dist_checkpointing opens its JSON config by path: checked first)
                reader.read(tag_dir / DIST / CONFIG)
            with verified_reads(reader):  # (its pickled .metadata, the .distcp tensors, an older release's common.pt)
                loaded = dist_checkpointing.load(self._sharded(is_loading=not fresh), str(tag_dir / DIST))
        except BaseException:
            [state.update(was) for state, was in moments]  # (a failed load leaves the moments: trainguard.recovery.degrade)
            raise
        for i, chunk in enumerate(mg.chunks):
            _unwrap(chunk).load_state_dict(loaded[f"model{i}" if len(mg.chunks) > 1 else "model"])
        mg.optimizer.load_state_dict(loaded["optimizer"])
        _step_from_groups(mg.optimizer)
        return self._loaded(man, now)

    def _loaded(self, man, now: dict):
        self._main_params_to_model(man.layout.get("precision"), now["precision"])
        self.mg.iteration = man.step
        return None, {}

    def load_shard(self, own: Path, tag: str, reader, purpose: str, **kwargs):
        """This rank's shard of a snapshot in node memory (megatron_hooks.snapshots)."""
        self.shard.load(reader, own / tag)
        self._main_params_to_model()
        return None, {}

    def shard_source(self):
        self.shard = MegatronShard(self)
        return self.shard


def _same_layout(tag_dir: Path, saved: dict, now: dict) -> None:
    """Each rank's own state loads only at the layout it was written at (:data:`OWN_STATE_LAYOUT`)."""
    differ = {k: (saved.get(k), now[k]) for k in OWN_STATE_LAYOUT if saved.get(k) != now[k]}
    if differ:
        raise CheckpointError(f"trainguard: {tag_dir} holds each rank's own state at another layout "
                              f"(saved, now: {differ}): it loads only where it was written")


def _distributed(optimizer) -> bool:
    """Whether ``optimizer`` is (or chains) megatron's distributed optimizer."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(o, DistributedOptimizer) for o in _optimizers(optimizer))


def _stateless(optimizer) -> bool:
    """No update applied yet (fp16's scale search skipped them): no moments to save. Such a snapshot loads the optimizer
    fresh, as it was then -- not asked for moments it never had. (Not the distributed one: its dummies, load().)"""
    return not _distributed(optimizer) and not any(getattr(o, "optimizer", o).state for o in _optimizers(optimizer))


def _step_from_groups(optimizer) -> None:
    """The distributed optimizer over torch's Adam (no apex/TE) keeps the step count twice: in its
    param groups (what its state_dict saves, and loads correctly) and in each parameter's Adam
    state. megatron-core 0.16's load gives every parameter's state *one shared* step tensor (torch's
    Adam then adds 1 per parameter per step: 29 parameters, +29 a step) or leaves the value the
    state had before the load. Give each parameter its own step, the groups' value -- else Adam's
    bias correction is off after every resume and rollback."""
    for o in (o for o in _optimizers(optimizer) if _distributed(o)):
        for group in (g for g in o.optimizer.param_groups if "step" in g):
            for p in group["params"]:
                state = o.optimizer.state.get(p)
                if state and torch.is_tensor(state.get("step")):
                    old = state["step"]
                    state["step"] = torch.tensor(float(group["step"]), dtype=old.dtype, device=old.device)


__all__ = ["MegatronState", "STAGING"]  # (STAGING: where uncommitted snapshots live, under root)
