"""Megatron-core adapter: the same guard, config block, events and JSONL as the DeepSpeed one.

    import megatron_hooks
    model = [DistributedDataParallel(config, ddp_config, gpt_model)]        # your model chunks
    optimizer = get_megatron_optimizer(opt_config, model)
    guard = megatron_hooks.install(model, optimizer, "trainguard.json")   # or a dict / the ds_config
    for iteration in ...:
        losses = forward_backward_func(...)                                # unchanged
        update_successful, grad_norm, num_zeros = optimizer.step()         # the guard decides here
    guard.close()

What ``install`` does, on every rank:

- puts the guard's AGREE/DECIDE around ``optimizer.step()``: one all-reduce of the ``[world, 8]`` table over the
  default group, then every rank applies the step or skips it (a skipped step is ``optimizer.step()`` not called
  and the gradients zeroed: ``(False, None, None)`` comes back, as for an fp16 overflow);
- a tensor hook per parameter: each rank's *local* gradient is checked before megatron's
  data-parallel reduction (no second synchronisation: it rides in the same table);
- on the last pipeline stage, a forward hook reads the model's per-token loss (the local loss);
- forward hooks on every module record whether its output was finite (a device flag, read only on
  a non-finite step): the first non-finite module, the global layer number across pipeline stages
  (``TransformerLayer.layer_number``), and the *origin* rank -- a NaN that spread down the
  pipeline or through a tensor-parallel all-reduce is attributed to where it came first;
- the sampled probes (attention entropy from ``core_attention.scale_mask_softmax`` -- the local
  attention path only: fused/flash attention never materialises the probabilities -- and
  activation range) on sampled steps;
- every rank's (dp, tp, pp, cp, ep) coordinates from ``parallel_state``, in every verdict;
- fp16: megatron's ``DynamicGradScaler`` watched (its silent clamp at the minimum is a
  ``loss_scale`` collapse); the ladder resets the scale, raises its floor, and last turns the
  model chunks and optimizer into bf16 ones in place (megatron_hooks.precision).

Sample ids: call ``guard.on_batch(sample_ids)`` in your ``forward_step`` (optional). Forward passes in eval mode
(``model.eval()``, as Megatron-LM's ``evaluate`` does) are ignored.

Megatron-LM's own loop: ``trainguard run -- torchrun ... pretrain_gpt.py ... --trainguard-config tg.json``
(megatron_hooks.lm); :func:`extra_args_provider` is the argument it adds.

Snapshots: ``guard.checkpointer.save(dir, data_state=...)`` / ``.load(dir)`` (megatron_hooks.checkpoint);
with ``checkpoint.dir`` and ``checkpoint.every_steps`` the guard saves by itself (with what
``install(data_state=callable)`` returns) and resumes at ``install`` (``guard.iteration``,
``guard.resumed_data_state``). The step sequence is trainguard.step.driver's, as on DeepSpeed; keys this
adapter cannot apply are refused at ``install`` (trainguard.support.support).

The watchdog (``distributed.watchdog``) runs as on the DeepSpeed path: heartbeats, a hung rank named, stacks, exit
75 for a restart; under trainguard.supervise, ``supervised(train)`` survives a dead rank in-process (docs/liveness.md).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from trainguard import config as tg_config
from trainguard.ports import check_supported, releases

from megatron_hooks.capabilities import REFUSED
from megatron_hooks.args import extra_args_provider
from megatron_hooks.parts import _GradScaler, _dtype, _modules, _optimizers, _unwrap  # noqa: F401 (the package's)
from megatron_hooks.guard import MegatronGuard
from megatron_hooks.inprocess import supervised  # (your loop, entered again after a rank died)

__all__ = ["install", "extra_args_provider", "MegatronGuard", "supervised"]


def install(model: torch.nn.Module | Sequence[torch.nn.Module], optimizer, config: Any,
            start_iteration: int = 0, guard_enabled: bool = True, data_state=None, loop=None,
            replayer=None, train_iters: int | None = None) -> MegatronGuard:
    """Guard a megatron-core model (a module or a list of model chunks) and its optimizer.

    ``config``: the trainguard block as a dict, a JSON file (the block itself, or a ds_config-style
    file holding a ``"trainguard"`` key), or a parsed :class:`trainguard.config.TrainguardConfig`.
    Call after ``parallel_state.initialize_model_parallel`` and after the optimizer is built.
    ``guard_enabled=False``: only the configured faults (plain megatron under the same faults, for
    comparisons and drills). ``start_iteration``: where your loop is (e.g. after loading your own
    checkpoint): the automatic resume loads only a newer snapshot. ``loop``: for a training loop
    that owns its iteration counter (megatron_hooks.lm); None for yours. ``replayer``: a
    :class:`megatron_hooks.replay.Replayer` over your forward step (and your loop calls ``record`` with
    what each micro-batch drew): data or weights (``recovery.replay_check``, ``narrow_samples``) --
    Megatron-LM's loop has one; without it the ladders act as written. ``train_iters``: your loop's last iteration
    (its count goes on through a rollback: a young run's restart from the first step is refused where it would throw
    away more iterations than the run has left; None: not bounded)."""
    import megatron.core

    releases.check("megatron-core", megatron.core.__version__)  # (the support matrix: a release outside it refused)
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    cfg = tg_config.block_of(config, "megatron_hooks.install")
    check_supported(cfg, "megatron_hooks", REFUSED)  # a key set here that megatron cannot honour: refused, by name
    from trainguard.ports import check_release

    check_release(cfg, "megatron-core", megatron.core.__version__)  # (a key this release cannot run: refused)
    return MegatronGuard(chunks, optimizer, cfg, start_iteration=start_iteration, guard_enabled=guard_enabled,
                         data_state=data_state, loop=loop, replayer=replayer, train_iters=train_iters)
