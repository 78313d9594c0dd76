"""The block's sections on the run around the step (trainguard.config): ``distributed`` (process groups, the
watchdog, spares), ``checks`` and ``metrics`` (the event log and its mirrors)."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from trainguard.config.base import PathStr, PluginSpec, _Section


class WatchdogConfig(_Section):
    """Heartbeats and hang detection (trainguard.liveness.watchdog)."""

    enabled: bool = Field(True, description="Publish a heartbeat per rank and watch everyone's from a "
                          "background thread (no work on the training thread beyond attribute writes).")
    interval_s: float = Field(5.0, gt=0, description="How often each rank publishes and checks.")
    hang_timeout_s: float = Field(
        900.0, gt=0, description="A rank that has not progressed (changed phase) for this long is hung. Keep it "
        "below collective_timeout_s, so that the watchdog (which names the rank and dumps stacks) acts before "
        "a collective times out.")
    board: Literal["store", "dir"] = Field(
        "store", description="store: the rendezvous store (torchrun's, multi-node). dir: files in `dir` (a "
        "directory every rank can read).")
    dir: Optional[PathStr] = Field(None, description="board 'dir': where the heartbeat files go -- a folder of the "
                                   "job's user's own (made 0700; a link, a file or another user's folder is refused).")
    stacks_dir: Optional[PathStr] = Field(None, description="Where `stacks.rank<r>.txt` go on a hang (default: beside "
                                      "metrics.jsonl, else the working directory).")
    exit_code: int = Field(75, ge=1, le=255, description="Exit code of every live rank after a hang (75, "
                           "EX_TEMPFAIL: retry). torchrun restarts on any non-zero code; see the README.")
    kill_hung_local: bool = Field(True, description="SIGKILL the hung ranks on this host before exiting (a "
                                  "stopped process otherwise holds torchrun for its SIGTERM grace period).")

    @model_validator(mode="after")
    def _dir_for_dir_board(self):
        if self.enabled and self.board == "dir" and not self.dir:
            raise ValueError("board 'dir' needs 'dir' (a directory every rank can read)")
        return self


class DistributedConfig(_Section):
    """Process-group settings trainguard applies before the framework builds its groups."""

    collective_timeout_s: Optional[float] = Field(
        None, gt=0, description="Timeout of every collective in every process group - the default group and "
        "DeepSpeed's ZeRO/data-parallel groups alike (DeepSpeed's own `timeout` and DEEPSPEED_TIMEOUT reach only "
        "the default group, so a hung rank otherwise stalls the others for 30 minutes on gloo). null: the "
        "frameworks' defaults.")
    fresh_store_per_attempt: bool = Field(
        True, description="Under torchrun, create the default process group on a store prefix of its own per "
        "restart attempt (TORCHELASTIC_RESTART_COUNT): restarted gloo workers otherwise often fail to connect "
        "through stale peer addresses.")
    watchdog: WatchdogConfig = Field(default_factory=WatchdogConfig)
    spares: int = Field(0, ge=0, description="Hot spares, for a job launched under trainguard.supervise (`torchrun "
                        "--nproc-per-node N+S -m trainguard.supervise -- train.py ...`: the supervisor reads it from the "
                        "config file on the command line; `--spares` there wins): the last S of torchrun's workers wait, "
                        "warm, to take a dead rank's place in the same job (docs/liveness.md). Launched otherwise, a "
                        "warning says it is not in effect (a dead rank restarts the job).")


class ChecksConfig(_Section):
    """Start-of-run checks (one warning event each)."""

    enabled: bool = Field(True, description="Warn about fp16-where-bf16-works, missing or short warmup, no clipping.")
    min_warmup_steps: int = Field(100, ge=0, description="Warn when the LR warmup is shorter than this.")


class WandbConfig(_Section):
    """Weights & Biases: the metric lines and records mirrored to a run (rank 0)."""

    project: str = Field(description="The W&B project.")
    name: Optional[str] = Field(None, description="The run's name (default: W&B's).")
    dir: Optional[PathStr] = Field(None, description="Where W&B writes its files (default: W&B's, ./wandb).")
    mode: Optional[Literal["online", "offline", "disabled"]] = Field(
        None, description="W&B's mode (default: its environment, WANDB_MODE). offline: files only, `wandb sync` later.")


class MetricsConfig(_Section):
    """The JSONL event log, the run's source of truth."""

    jsonl: Optional[PathStr] = Field(
        "trainguard.jsonl",
        description="Event and metric log written by rank 0 (one JSON object per line). null: none.")
    per_rank: bool = Field(
        False, description="Also write one file per rank (`<stem>.rank<r>.jsonl`) with its local values.")
    every_steps: int = Field(1, ge=1, description="Write a metric line every N optimizer steps (events always).")
    incident_gap: int = Field(100, ge=0, description="Alerts (records a ladder does not act on) as incidents: the first "
                              "alert of a kind opens one and is written; the same kind within this many steps is "
                              "folded into it (counted, worst value kept); this many steps without one closes it "
                              "(an incident_closed record). 0: every alert written.")
    console: bool = Field(True, description="Rank 0 says on the console (stderr) what trainguard does: a banner at "
                          "start (what is on, where the log and checkpoints go), one line per incident and per action "
                          "(at most 30 a minute; the rest counted), a line at the end with the run's story in numbers. "
                          "false: silent (the log has it all).")
    tensorboard: Optional[PathStr] = Field(None, description="Directory for TensorBoard scalars (rank 0). null: off.")
    prometheus_port: Optional[int] = Field(
        None, ge=0, le=65535, description="Serve Prometheus metrics over HTTP from rank 0 on this port "
        "(0: any free port). null: off.")
    prometheus_addr: str = Field(
        "0.0.0.0", min_length=1, description="The address the Prometheus endpoint binds. 0.0.0.0 (every interface): "
        "a Prometheus server on another host must reach rank 0's node to scrape it. The endpoint serves training "
        "statistics and rank/host labels, no credentials and no controls; bind 127.0.0.1 (scraped through a local "
        "agent) or the node's cluster-network address where other networks can reach the node.")
    wandb: Optional[WandbConfig] = Field(None, description="Mirror to Weights & Biases (needs `pip install wandb`). "
                                         "null: off.")
    sinks: list[PluginSpec] = Field(
        default_factory=list, description="More mirrors of the log on rank 0, by type: 'tensorboard' (logdir), "
        "'prometheus' (port), 'wandb' (project, ...), or your own (trainguard.plugins.Sink: metric, event, close).")
