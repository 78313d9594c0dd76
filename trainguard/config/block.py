"""The whole "trainguard" block (trainguard.config): its key in a ds_config and its model, made of the sections."""
from __future__ import annotations

from pydantic import Field, model_validator

from trainguard.config.base import _Section
from trainguard.config.checkpoint import CheckpointConfig
from trainguard.config.detectors import DetectorsConfig
from trainguard.config.faults import FAULTS_REFUSED, FaultSpec
from trainguard.config.recovery import RecoveryConfig
from trainguard.config.runtime import ChecksConfig, DistributedConfig, MetricsConfig
from trainguard.config.training import ClippingConfig, DataConfig, SanitizeConfig

BLOCK = "trainguard"


class TrainguardConfig(_Section):
    """The whole block. Defaults are the ones to run production with."""

    enabled: bool = Field(True, description="false: DeepSpeed's own behaviour, unchanged.")
    detectors: DetectorsConfig = Field(default_factory=DetectorsConfig)
    clipping: ClippingConfig = Field(default_factory=ClippingConfig)
    sanitize: SanitizeConfig = Field(default_factory=SanitizeConfig)
    checks: ChecksConfig = Field(default_factory=ChecksConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    recovery: RecoveryConfig = Field(default_factory=RecoveryConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    allow_faults: bool = Field(
        False, description="Must be true for 'faults' to be accepted, so that a production config "
        "cannot carry one by accident.")
    faults: list[FaultSpec] = Field(default_factory=list, description="Faults to inject (testing only).")
    callbacks: list[str] = Field(
        default_factory=list,
        description="Your record subscribers, as 'package.module:function': each is called with every event record "
        "(the dict of a JSONL event line) on rank 0, on a background thread, never inside the training step; one "
        "that raises is logged and the run goes on. A path that does not import is a ConfigError at start. Each is "
        "imported at initialize: its code runs with the job's rights (treat the block as code); `trainguard validate` "
        "checks the block without importing them.")

    def detectors_on(self) -> list[str]:
        """The built-in detectors the block switches on, in the order of its ``detectors`` section: what the banner and
        ``trainguard validate`` both say."""
        return [name for name in type(self.detectors).model_fields if getattr(getattr(self.detectors, name), "enabled",
                                                                               False) is True]

    @model_validator(mode="after")
    def _faults_need_permission(self):
        if self.faults and not self.allow_faults:
            raise ValueError(FAULTS_REFUSED)
        snap, disk = self.checkpoint.snapshot, self.checkpoint.every_steps
        for f in (f for f in self.faults if f.during == "snapshot"):
            if not snap.every_steps or snap.max_overhead is None and (f.step % snap.every_steps or disk and not
                                                                       f.step % disk):
                raise ValueError(f"faults: kill_rank during 'snapshot' at step {f.step} needs a snapshot taken there: "
                                 "checkpoint.snapshot.every_steps dividing it, and no disk checkpoint at that step "
                                 "(checkpoint.every_steps), which stands in for the snapshot")
        return self
