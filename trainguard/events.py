"""Where the guard runs in the training loop, and the records it writes.

:class:`Event` is the single list of loop points. Its docstring is the loop, in pseudocode; the
guard (:class:`trainguard.step.guard.StepGuard`) has exactly one ``on_<event>`` method per member, and a
test keeps the two equal.
"""
from __future__ import annotations

import enum


class Event(str, enum.Enum):
    """The step as the guard sees it, on every framework (one optimizer step; ``micro`` repeats for
    gradient accumulation / megatron's micro-batches). AGREE .. END and what follows them are
    :class:`trainguard.step.driver.StepDriver`, written once; the adapters only reach its start
    (DeepSpeed: ``engine.step()`` at the accumulation boundary; megatron: ``optimizer.step()``)::

        BEGIN       once, after the engine / model and optimizer exist: gather every rank's coordinates
                    and host, open the event log (rank 0), arm the fault injector, resume from the
                    newest checkpoint that verifies (checkpoint.dir), start the watchdog
        for each optimizer step:
            for each micro-batch:
                BATCH      the loader hands out a batch: record its sample ids and data position
                           (DeepSpeed: the loader ds_plugins.initialize built; megatron: guard.on_batch)
                FORWARD    the model's forward: injected faults poison the inputs; sampled probes open
                LOSS       the local loss is checked (a device-side flag, no host sync): DeepSpeed's
                           engine.backward(loss); megatron: the last pipeline stage's output
                BACKWARD   the *local* gradients' norms (one multi-tensor launch where the framework
                           reduces a bucket, ZeRO-3: a tensor hook per parameter) -- before the
                           framework's data-parallel reduction (every ZeRO stage; megatron's DDP)
            AGREE      ONE all-reduce of a [world, fields] tensor (each rank fills its own row); one
                       host sync reads it; every rank now holds every rank's flags, loss and norm
            DECIDE     pure detectors turn the gathered observations into verdicts; the policy turns
                       verdicts into one action -- the same on every rank, since every rank
                       computed it from the same tensor: CONTINUE | SKIP_STEP | ROLLBACK | ABORT
            STEP       apply the optimizer step, or take the framework's own skip path (no update,
                       gradients cleared); an fp16 scaler collapse turns into the loss_scale ladder
            END        metric line (rank 0; every rank when per_rank), events, counters
            then       ROLLBACK: the chosen checkpoint loaded in place, the data moved past the bad
                       batches, the LR lowered; loss_scale: reset / raise the floor / bf16 --
                       else: health marks (stable, trajectory, resume self-test), a periodic
                       snapshot when due; goodput
        CLOSE       flush and close the logs
    """

    BEGIN = "begin"
    BATCH = "batch"
    FORWARD = "forward"
    LOSS = "loss"
    BACKWARD = "backward"
    AGREE = "agree"
    DECIDE = "decide"
    STEP = "step"
    END = "end"
    CLOSE = "close"


class _Word(str, enum.Enum):
    """A closed vocabulary whose members read (and format, in f-strings and JSON) as their values, and hash
    as them: a member finds what is keyed by its value (``recovery.ladders["nonfinite"]``), and back."""

    def __str__(self) -> str:
        return self.value

    def __hash__(self) -> int:
        return str.__hash__(self)


class Anomaly(_Word):
    """The classes the recovery ladders act on (``recovery.ladders``), as detectors name them in verdicts.
    Other verdicts (attention entropy, activation range, stragglers, your detectors) alert."""

    NONFINITE = "nonfinite"          # a rank's local loss or gradients were NaN/Inf
    OVERFLOW = "overflow"            # fp16: gradients overflowed, losses finite (the scaler's routine: no ladder)
    INSTANT_BURST = "instant_burst"  # loss spike with the gradient norm jumping in one step: a bad batch
    SLOW_RISE = "slow_rise"          # loss spike after the gradient norm crept up: the LR is too high
    LOSS_SCALE = "loss_scale"        # the fp16 scaler collapsed
    REPLICA_MISMATCH = "replica_mismatch"  # data-parallel replicas hold different weights (detectors.replica_check)
    COMPUTE_MISMATCH = "compute_mismatch"  # a rank computes differently from its replicas (detectors.peer_replay)


class Remedy(_Word):
    """What the loss_scale ladder's rollback does to the scaler afterwards (trainguard.step.driver.scale_remedy):
    its rung's name, so that a ladder step, a decision and the record that carries it out say the same."""

    RESET_SCALE = "reset_scale"      # rung "rollback"
    RAISE_FLOOR = "raise_floor"
    BF16_FALLBACK = "bf16_fallback"


class Phase(_Word):
    """Where a rank is in its step, as its heartbeat says (trainguard.liveness.watchdog): a phase change is progress,
    and a hang report names the phase each rank stalled in."""

    START = "start"
    DATA = "data"
    FORWARD = "forward"
    BACKWARD = "backward"
    COLLECTIVE = "collective"
    CHECKPOINT = "checkpoint"
    EVAL = "eval"
    DONE = "done"


class Record(str, enum.Enum):
    """Values of the ``event`` field of an event line in the JSONL log (docs/events.md lists exactly
    these). The vocabulary is closed: :meth:`trainguard.observe.eventlog.EventLog.emit` writes members only."""

    RUN_START = "run_start"          # config hash, world layout, versions
    NONFINITE = "nonfinite"          # a rank's local loss, gradients or a sampled activation were NaN/Inf
    INSTANT_BURST = "instant_burst"  # loss spike, gradient norm jumped within one step: a bad batch
    SLOW_RISE = "slow_rise"          # gradient norm creeping up (before or at a loss spike): LR too high
    GRAD_SURGE = "grad_surge"        # gradient norm far above its recent distribution
    ENTROPY_COLLAPSE = "entropy_collapse"      # an attention head attends to a single token
    ENTROPY_SATURATION = "entropy_saturation"  # an attention head attends uniformly
    ACTIVATION_RANGE = "activation_range"      # a module's output max-abs above the limit
    REPLICA_MISMATCH = "replica_mismatch"      # a rank's replicated weights differ from its replicas' (silent corruption)
    COMPUTE_MISMATCH = "compute_mismatch"      # a rank's replay of a micro-batch differs from its replicas' (silent)
    CUSTOM_ALERT = "custom_alert"              # a verdict of one of your detectors (detectors.custom)
    STRAGGLER = "straggler"                    # a rank alive but slower than the median rank (alert only)
    SAMPLES_REJECTED = "samples_rejected"      # the sanitiser dropped samples or quarantined a batch
    ROLLBACK = "rollback"                      # in-process rollback carried out (to_tag, skipped batches, LR)
    ROLLBACK_UNAVAILABLE = "rollback_unavailable"  # no checkpoint predates the onset: the step was skipped
    RECOVERY_FAILED = "recovery_failed"        # a rollback target failed to load: the next one, or on
    OVERFLOW = "overflow"                      # fp16: gradients overflowed, losses finite (the scaler's routine)
    LOSS_SCALE = "loss_scale"                  # fp16 scaler collapsed (overflow at its floor / endless streak)
    LOSS_SCALE_RESET = "loss_scale_reset"      # scale reset (and floor raised) after a loss_scale rollback
    PRECISION_FALLBACK = "precision_fallback"  # the engine was re-created in bf16
    INCIDENT_CLOSED = "incident_closed"        # alerts of one kind stopped: count, first/last step, worst value
    SUSPECT_RANK = "suspect_rank"              # one rank is the culprit again and again, on different data
    FP16_WHERE_BF16 = "fp16_where_bf16"        # start-of-run checks (action "warn")
    NO_WARMUP = "no_warmup"
    SHORT_WARMUP = "short_warmup"
    NO_CLIPPING = "no_clipping"
    OFF_AT_THIS_LAYOUT = "off_at_this_layout"  # a check the block switched on that this layout cannot run (DP=1)
    FRAMEWORK_SKIP = "framework_skip"  # DeepSpeed skipped a step the guard did not flag (e.g. fp16 scaler)
    FAULT_INJECTED = "fault_injected"  # a configured fault fired (tests, demo, drills)
    ABORT = "abort"                  # the run stops on every rank; detail holds the report
    CHECKPOINT_SAVED = "checkpoint_saved"      # a checkpoint was committed
    SNAPSHOT_SAVED = "snapshot_saved"          # the in-memory tier: every rank's shard committed in node memory
    CHECKPOINT_FAILED = "checkpoint_failed"    # an async save failed; it stays invisible, training goes on
    SNAPSHOTS_OFF = "snapshots_off"            # the in-memory tier stopped writing on a rank (repeated failures)
    CHECKPOINT_STABLE = "checkpoint_stable"    # the stable_after steps after a checkpoint passed cleanly
    CHECKPOINT_INVALID = "checkpoint_invalid"  # a checkpoint failed verification and was passed over
    RESUME = "resume"                          # a checkpoint was loaded to resume the run
    RESUME_SKIPPED = "resume_skipped"          # a resume was asked for, but no checkpoint qualified
    FRESH_START = "fresh_start"                # nothing to resume from: a new run (or resume "none", by choice)
    RESUME_VERIFIED = "resume_verified"        # the losses after a resume continued the recorded ones
    RESUME_DISCONTINUITY = "resume_discontinuity"  # ... and did not
    HANG_DETECTED = "hang_detected"            # the watchdog: a rank stopped making progress
    RESTART = "restart"                        # a restarted attempt resumed (downtime, previous heartbeats)
    RANK_REPLACED = "rank_replaced"            # a dead rank's place taken by a spare, the survivors' processes kept
    HANDOVER = "handover"            # a framework's own check handed to trainguard (Megatron-LM's NaN check)
    RUN_END = "run_end"              # totals


class Action(str, enum.Enum):
    """What the policy decided; every rank takes the same one in the same step."""

    CONTINUE = "continue"
    SKIP_STEP = "skip_step"
    ROLLBACK = "rollback"
    ABORT = "abort"
