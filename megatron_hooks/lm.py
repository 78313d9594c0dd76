"""Megatron-LM's own training loop (``megatron.training``: ``pretrain_gpt.py`` and the other entry
scripts of a Megatron-LM checkout), guarded by one argument:

    trainguard run -- torchrun --nproc-per-node 8 pretrain_gpt.py <its arguments> --trainguard-config tg.json

``trainguard run`` puts trainguard's bootstrap first on PYTHONPATH; when the script imports
``megatron.training``, :func:`install_entry` wraps three of its functions in place (the user's
script is never copied or edited):

``arguments.add_megatron_arguments`` (adds ``--trainguard-config FILE``, validated at parse time),
``training.setup_model_and_optimizer`` (after Megatron-LM's own ``--load``, :func:`megatron_hooks.install` guards
the model chunks, optimizer and scheduler) and ``training.train`` (its ``forward_step_func`` names each
micro-batch's samples; the guard closes when it returns). Without the argument nothing changes. Who owns what:

- **NaN/Inf**: Megatron-LM's ``check_for_nan_in_loss_and_grad`` (on by default) makes its rerun
  state machine rerun the step and exit 16/17 *before* ``optimizer.step()``. With the guard's
  non-finite detector on, that check is handed to trainguard (``args.check_for_nan_in_loss_and_grad``
  set to False before the model is wrapped, a ``handover`` record says so): trainguard checks the
  same local loss and gradients, names rank, coordinates and first layer, and skips the step on every
  rank. Megatron-LM's other checks (``--check-for-spiky-loss``, ``--check-for-large-grads``) stay its own.
- **A step trainguard does not apply** comes back from ``optimizer.step()`` as ``(False, None, None)``,
  as an fp16 overflow does: Megatron-LM logs a skipped iteration and still advances its iteration and
  consumed samples. trainguard also advances the LR scheduler by that iteration's samples, so after a
  fault the run's iteration, consumed samples and LR are those of a run without it.
- **Rollback**: the weights, optimizer state and RNG come back from the snapshot; Megatron-LM's
  ``train()`` keeps its iteration in a local variable, so the loop goes on: iteration, consumed
  samples, LR schedule and data position move on as in a run without the fault (the batches between
  the snapshot and the fault are not replayed: the bad window is skipped). The ``rollback`` record
  says so under ``loop``.
- **Snapshots and Megatron-LM's checkpoints**: trainguard's snapshots live in ``checkpoint.dir``
  (never Megatron-LM's ``--save`` directory: refused at start), beside Megatron-LM's own. At start,
  Megatron-LM's ``--load`` runs first; a trainguard snapshot is loaded only when it is *newer* than
  the iteration that brought, and then also sets Megatron-LM's iteration, consumed samples and
  scheduler (saved with every snapshot). One state is loaded, never two.
"""
from __future__ import annotations

import functools
import sys

from megatron_hooks.capabilities import LM_FLAGS_REFUSED
from trainguard import config as tg_config
from trainguard.bootstrap import wrap_once
from trainguard.ports import check_own_dir, DataPosition, refuse_flags
from trainguard.events import Record

__all__ = ["install_entry", "LMRun"]

_RUN: "LMRun | None" = None


def install_entry() -> None:
    """Wrap Megatron-LM's argument parsing, model/optimizer setup and training loop (idempotent)."""
    from megatron.training import arguments, training

    import megatron_hooks

    wrap_once(arguments, "add_megatron_arguments",
              lambda add: lambda parser: megatron_hooks.extra_args_provider(add(parser)))
    def make_parse(parse):
        def parse_args(*args, **kwargs):
            parsed = parse(*args, **kwargs)
            _refuse_conflicts(parsed)
            return parsed
        return parse_args

    # (core_v0.19's pretrain_gpt.py parses once for its in-process restart wrapper before anything else;
    # core_v0.17's initialize binds parse_args at import)
    wrap_once(arguments, "parse_args", make_parse)
    initialize = sys.modules.get("megatron.training.initialize")
    if initialize is not None and hasattr(initialize, "parse_args"):
        wrap_once(initialize, "parse_args", make_parse)
    wrap_once(training, "setup_model_and_optimizer",
              lambda setup: lambda *args, **kwargs: _setup(setup, *args, **kwargs))

    def make_train(train):
        def guarded_train(forward_step_func, *args, **kwargs):
            run = _RUN
            if run is None:
                return train(forward_step_func, *args, **kwargs)
            try:
                result = train(run.wrap_forward_step(forward_step_func), *args, **kwargs)
            except BaseException as e:
                run.close(clean=isinstance(e, SystemExit) and e.code in (0, None), why=e)  # (else node memory's
                # snapshots stay for the restart; run_end says why)
                raise
            run.close()
            return result
        return guarded_train

    wrap_once(training, "train", make_train)
    from megatron_hooks.inprocess import install  # (trainguard.supervise: pretrain() entered again after a death)
    install(_let_go)


def _let_go():  # (the guard's run, taken and forgotten: megatron_hooks.inprocess.teardown, Megatron-LM let go)
    global _RUN
    run, _RUN = _RUN, None
    return run


def _setup(setup, *args, **kwargs):
    global _RUN
    from megatron.training import get_args

    margs = get_args()
    path = getattr(margs, "trainguard_config", None)
    if not path:
        return setup(*args, **kwargs)
    cfg = tg_config.block_of(path, "--trainguard-config")
    _check_dirs(cfg, margs)
    container = kwargs.get("cfg_container")  # (core_v0.18+: pretrain()'s config container, built before the model)
    handovers = []
    if cfg.detectors.nonfinite.enabled and getattr(margs, "check_for_nan_in_loss_and_grad", False):
        # (before setup: get_model builds the DDP config, whose gradient check reads it)
        margs.check_for_nan_in_loss_and_grad = False
        _clear(getattr(container, "ddp", None), "check_for_nan_in_grad")
        _clear(getattr(container, "rerun_state_machine", None), "check_for_nan_in_loss")
        handovers.append({"framework": "Megatron-LM", "setting": "check_for_nan_in_loss_and_grad", "was": True,
                          "now": False, "why": "Megatron-LM's rerun state machine would rerun the step and exit "
                          "16/17 before optimizer.step(); trainguard checks the same local loss and gradients, names "
                          "the rank, its coordinates and the first layer, and skips the step on every rank"})
    if cfg.detectors.loss_spike.enabled and getattr(margs, "check_for_spiky_loss", False):
        margs.check_for_spiky_loss = False  # (pretrain_gpt.py's loss_func reads it at every call)
        _clear(getattr(container, "rerun_state_machine", None), "check_for_spiky_loss")
        handovers.append({"framework": "Megatron-LM", "setting": "check_for_spiky_loss", "was": True, "now": False,
                          "key": "trainguard.detectors.loss_spike",
                          "why": "Megatron-LM would rerun a spiky step and, when it repeats, save and exit asking for "
                          "a rerun on another GPU; trainguard's loss_spike detector classifies the spike (instant "
                          "burst or slow rise) and runs its ladder (skip, roll back, lower the LR) in the job"})
    model, optimizer, scheduler = setup(*args, **kwargs)
    _RUN = LMRun(model, optimizer, scheduler, margs, cfg, handovers)
    return model, optimizer, scheduler


def _refuse_conflicts(args) -> None:
    """At Megatron-LM's argument parsing: a flag of LM_FLAGS_REFUSED that conflicts with the block stops the launch."""
    path = getattr(args, "trainguard_config", None)
    if path:
        refuse_flags(tg_config.block_of(path, "--trainguard-config"), args, LM_FLAGS_REFUSED,
                     f"--trainguard-config {path}", "Megatron-LM")


def _check_dirs(cfg, margs) -> None:
    """trainguard's snapshots and Megatron-LM's checkpoints (``--save``, ``--load``) in one directory: refused."""
    check_own_dir(cfg.checkpoint.dir, {f"--{f}": getattr(margs, f, None) for f in ("save", "load")}, "Megatron-LM")


def _clear(section, name: str) -> None:
    if section is not None and getattr(section, name, False):
        setattr(section, name, False)


class LMRun:
    """The guard over one Megatron-LM run (per rank): Megatron-LM's loop state (iteration, consumed
    samples, scheduler) saved with each snapshot and set back on resume; the LR scheduler moved on
    for the steps trainguard does not apply; the loop counter kept on a rollback."""

    def __init__(self, model, optimizer, scheduler, margs, cfg, handovers: list[dict]):
        import megatron_hooks

        self.margs = margs
        self.scheduler = scheduler
        self._micro = 0
        self._iteration_seen = None
        self.closed = False
        loaded = int(getattr(margs, "iteration", 0) or 0)  # (Megatron-LM's own --load, if any)
        from megatron_hooks.replay import Replayer
        # data or weights: a micro-batch replayed through Megatron-LM's own forward step (set at train())
        self.replayer = Replayer(model, None, margs.seq_length, margs.micro_batch_size, args=margs) \
            if cfg.recovery.replay_check else None
        self.guard = megatron_hooks.install(model, optimizer, cfg, start_iteration=loaded,
                                            data_state=self.loop_state, loop=self, replayer=self.replayer)
        self.guard.session.scale_in_scheduler(scheduler)  # (a lowered LR is the one Megatron-LM logs and saves)
        if self.guard.resumed_data_state is not None:
            self.restore(self.guard.resumed_data_state)
        for handover in handovers:
            self.guard.session.emit(self.guard.iteration, Record.HANDOVER, detail=handover)
        tracker = getattr(margs, "result_rejected_tracker_filename", None)
        if tracker:
            from megatron_hooks.rerun_tracker import RerunTracker

            self.guard.session.mirror(lambda coords: RerunTracker(tracker, coords))

    # ------------------------------------------------------------------ Megatron-LM's loop state
    def warmup_steps(self) -> int | None:
        """Megatron-LM's LR warmup in iterations (its scheduler counts samples), for the start-of-run
        checks; None when it has none."""
        samples = int(getattr(self.scheduler, "lr_warmup_steps", 0) or 0) if self.scheduler is not None else -1
        if samples < 0:
            return -1
        return samples // max(1, self._samples_per_iteration()) if samples else None

    def last_step(self) -> int | None:  # (--train-iters, or what --train-samples come to: its count goes on)
        return int(self.margs.train_iters) if getattr(self.margs, "train_iters", None) else None

    def _samples_per_iteration(self) -> int:
        from megatron.core import parallel_state as ps
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        return get_num_microbatches() * self.margs.micro_batch_size * ps.get_data_parallel_world_size()

    def loop_state(self) -> dict:
        """Saved with each snapshot, from inside ``optimizer.step()`` of iteration ``n``: Megatron-LM
        counts that iteration's samples, and steps its scheduler for an applied update, after the
        step returns -- both are added here, so the state is the one after iteration ``n``."""
        per_iteration = self._samples_per_iteration()
        scheduler = None
        if self.scheduler is not None:
            scheduler = self.scheduler.state_dict()
            if self.guard.last_applied:
                scheduler["num_steps"] = scheduler["num_steps"] + per_iteration
        return {"megatron_lm": {
            "iteration": self.guard.iteration,
            "consumed_train_samples": int(self.margs.consumed_train_samples) + per_iteration,
            "skipped_train_samples": int(getattr(self.margs, "skipped_train_samples", 0) or 0),
            "consumed_valid_samples": int(getattr(self.margs, "consumed_valid_samples", 0) or 0),
            "scheduler": scheduler}}

    def restore(self, state: dict) -> None:
        """After a resume from a snapshot, before Megatron-LM builds its data iterators: they start
        at ``consumed_train_samples``, ``train()`` at ``iteration``."""
        loop = (state or {}).get("megatron_lm")
        if not loop:
            return
        m = self.margs
        m.iteration = self.guard.iteration = int(loop["iteration"])
        m.consumed_train_samples = int(loop["consumed_train_samples"])
        m.skipped_train_samples = int(loop.get("skipped_train_samples", 0))
        m.consumed_valid_samples = int(loop.get("consumed_valid_samples", 0))
        if self.scheduler is not None and loop.get("scheduler") is not None:
            self.scheduler.num_steps = 0  # (its load_state_dict adds the saved count to the current one)
            self.scheduler.load_state_dict(loop["scheduler"])

    # ------------------------------------------------------------------ megatron_hooks.MegatronGuard's loop
    def not_applied(self) -> None:
        """A step trainguard skipped: Megatron-LM steps its scheduler only for applied updates; the
        LR follows the iteration here, as in a run without the fault."""
        if self.scheduler is not None:
            self.scheduler.step(increment=self._samples_per_iteration())

    def rolled_back(self, loaded_step: int, step: int) -> dict:
        if self.scheduler is not None:  # (the optimizer's param groups came back with the snapshot's LR)
            self.scheduler.step(increment=0)
        return {"iteration": step, "weights_from_step": loaded_step,
                "kept": ["iteration", "consumed_train_samples", "lr_schedule", "data_position"],
                "not_replayed_iterations": [loaded_step + 1, step],
                "why": "Megatron-LM's train() keeps its iteration in a local variable: the loop goes on, the "
                       "weights, optimizer state and RNG come back"}

    # ------------------------------------------------------------------ micro-batches
    def wrap_forward_step(self, func):
        from megatron_hooks.replay import Recording

        if self.replayer is not None:
            self.replayer.forward_step_func = func  # (replays run the script's own, unwrapped)

        @functools.wraps(func)
        def forward_step(data_iterator, model, *args, **kwargs):
            self.on_micro_batch()
            if self.replayer is None or not model.training:
                return func(data_iterator, model, *args, **kwargs)
            # what this rank draws for the micro-batch (tensor-parallel rank 0 reads and broadcasts; the first and
            # last stages read), kept for a replay
            recording = Recording(data_iterator) if data_iterator is not None else None
            out = func(recording if recording is not None else data_iterator, model, *args, **kwargs)
            self.guard.record(recording.drawn if recording is not None else [])
            return out

        return forward_step

    def on_micro_batch(self) -> None:
        """Megatron-LM's loop sets ``args.curr_iteration`` before each train step (skipped iterations
        included): the guard's count follows it; the sample positions are those of Megatron-LM's
        ``single`` sampler (in order from ``consumed_train_samples``, each data-parallel rank its slice)."""
        m = self.margs
        current = int(getattr(m, "curr_iteration", self.guard.iteration))
        if current != self._iteration_seen:
            self._iteration_seen, self._micro, self.guard.iteration = current, 0, current
        if getattr(m, "dataloader_type", "single") == "single":
            from megatron.core import parallel_state as ps  # (imported already: megatron.training is)

            mbs, dp = m.micro_batch_size, ps.get_data_parallel_world_size()
            first = int(m.consumed_train_samples) + self._micro * mbs * dp + ps.get_data_parallel_rank() * mbs
            self.guard.on_batch(list(range(first, first + mbs)),
                                DataPosition(epoch=0, batch_in_epoch=current, consumed_samples=int(m.consumed_train_samples)))
        self._micro += 1

    def close(self, clean: bool = True, why: BaseException | None = None) -> None:
        if not self.closed:
            self.closed = True
            self.guard.close(clean, why)
