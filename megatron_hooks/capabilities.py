"""What megatron_hooks cannot honour, declared once (trainguard.support.support reads it through the ``trainguard.adapters``
entry point; ``install`` and Megatron-LM's ``--trainguard-config`` refuse a key set here by name). Its advice in
the core's records and errors: ``HINTS``."""
from __future__ import annotations

from trainguard.ports import Refusal, World

VARIANTS = ("megatron_hooks",)
LAUNCH_FLAGS = {"--trainguard-config": "megatron_hooks"}  # (Megatron-LM's argument: `trainguard run` checks its file)

_YOUR_LOADER = ("the data loader is yours (Megatron-LM's or your loop's), so trainguard never sees the samples; "
                "check them in your dataset")
_GROUPS_EXIST = ("the process groups exist before install() (Megatron-LM and your script create them); set the "
                 "timeout where they are created (Megatron-LM: --distributed-timeout-minutes)")
_DATA = Refusal("the data loader is yours (Megatron-LM's or your loop's): its shuffling, drop_last and data position "
                "are its own")

# what the core's records and errors advise on this adapter (trainguard.support.support.HINT_KEYS)
HINTS = {"sample_ids": "call guard.on_batch(sample_ids) in your forward_step (Megatron-LM's loop does)",
         "replay": "megatron_hooks.install(..., replayer=Replayer(...)) and guard.record(...) per micro-batch, as "
                   "Megatron-LM's loop does"}

REFUSED: dict[str, dict[str, Refusal]] = {
    "sanitize.enabled": {"megatron_hooks": Refusal(_YOUR_LOADER, inert=(False,))},
    "sanitize.": {"megatron_hooks": Refusal(_YOUR_LOADER, inert=(None,))},
    "data.": {"megatron_hooks": _DATA},
    "distributed.collective_timeout_s": {"megatron_hooks": Refusal(_GROUPS_EXIST, inert=(None,))},
    "distributed.fresh_store_per_attempt": {"megatron_hooks": Refusal(
        "the default process group exists before install(): its store cannot be chosen any more (launch under "
        "`trainguard run --`: a restarted attempt's init_process_group then gets a store of its own)", inert=(False,))},
    "recovery.skip_batches": {"megatron_hooks": Refusal(
        "your data iterator cannot be moved by a rollback (it continues past the batches already seen); set 0",
        inert=(0,))},
    "checkpoint.async": {"megatron_hooks": Refusal(
        "snapshots are written synchronously (dist_checkpointing's async writer is not under the commit protocol "
        "yet)", inert=(False,))},
    "clipping.mode": {"megatron_hooks": Refusal(
        "clipping by value clamps each local gradient in a hook, and megatron's gradients there carry the loss scale "
        "divided by your number of micro-batches, which the guard does not know; use norm or adaptive",
        inert=("deepspeed", "norm", "adaptive"))},
    "clipping.value": {"megatron_hooks": Refusal("only used by clipping.mode \"value\" (refused on megatron)")},
    "faults[].type": {"megatron_hooks": Refusal(
        "bad_label needs the loader of ds_plugins; on megatron use nan_batch (with sample: one bad sample), nan_loss, "
        "inf_activation or inf_grad", inert=("nan_loss", "inf_grad", "spike_batch", "lr_ramp", "inf_activation",
                                              "nan_batch", "attention_collapse", "kill_rank", "hang_rank",
                                              "corrupt_checkpoint", "fp16_overflow", "slow_rank", "nan_weights",
                                              "bitflip", "sdc_compute", "force_action"))},
}


# Megatron-LM's own resilience features that trainguard cannot run beside (docs/megatron.md's table):
# the flag, when it conflicts (given the parsed arguments and the block), why, and the trainguard key instead
LM_FLAGS_REFUSED = [
    ("--inprocess-restart", lambda a, cfg: bool(getattr(a, "inprocess_restart", False)) and not World.supervised(),
     "NVIDIA resiliency-ext's in-process restart (NCCL >= 2.26.2 and CUDA) re-enters pretrain() after aborting the "
     "job's collectives, which trainguard's hooks, watchdog and snapshot writer have not been run under yet",
     "trainguard's own in-process restart: torchrun --nproc-per-node N+S -m trainguard.supervise --spares S -- "
     "pretrain_gpt.py ... (gloo; docs/liveness.md), or a restart at the process level: trainguard run -- torchrun "
     "--max-restarts=N ... (the restart resumes from the newer of --load and trainguard.checkpoint.dir)"),
    ("--non-persistent-ckpt-type local", lambda a, cfg: getattr(a, "non_persistent_ckpt_type", None) == "local"
     and bool(cfg.checkpoint.dir),
     "Megatron-LM's local checkpoints (and their --replication) are a second fast tier beside trainguard's "
     "snapshots, loaded by Megatron-LM's --load before trainguard chooses, with no manifest trainguard can verify; "
     "two tiers that can disagree on the newest state are refused",
     "trainguard.checkpoint.every_steps (verified snapshots, the newer of them and --load resumes), or leave "
     "trainguard.checkpoint.dir unset to keep Megatron-LM's local checkpoints"),
]
