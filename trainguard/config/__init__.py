"""The typed "trainguard" block, parsed once where the JSON enters.

The block lives in the same ds_config that DeepSpeed reads (DeepSpeed ignores unknown top-level
blocks and stores them in its checkpoints). Everything downstream receives these frozen models,
never the raw dict. Unknown keys are errors naming the full path with a did-you-mean; every
problem is collected into one :class:`ConfigError`.

The JSON Schema (``configs/trainguard.schema.json``) and the reference page
(``docs/config-reference.md``) are generated from these models: ``python -m trainguard.support.reference``.

One module per part, all of it importable from here: ``base`` (what every section shares), ``detectors``,
``training`` (clipping, sanitize, data), ``checkpoint``, ``recovery``, ``runtime`` (distributed and its
watchdog, checks, metrics), ``faults``, ``block`` (the whole block, :class:`TrainguardConfig`) and ``parsing``
(reading a ds_config, validating the block, its hash).

May import trainguard.errors only: every room reads its frozen models, none is read by it.
"""
from trainguard.config.base import PathStr, PluginSpec
from trainguard.config.block import BLOCK, TrainguardConfig
from trainguard.config.checkpoint import CheckpointConfig, SnapshotConfig
from trainguard.config.detectors import (ActivationRangeConfig, AttentionEntropyConfig, DetectorsConfig,
                                         GradNormConfig, LocalizeConfig, LossScaleConfig, LossSpikeConfig,
                                         LossTrendConfig, NonfiniteConfig, PeerReplayConfig, ReplicaCheckConfig,
                                         StragglerConfig)
from trainguard.config.faults import FAULT_TYPES, FAULTS_REFUSED, FaultSpec
from trainguard.config.parsing import block_of, config_hash, load, parse_block, read_json
from trainguard.config.recovery import SCALE_ONLY_STEPS, LadderStep, RecoveryConfig
from trainguard.config.runtime import ChecksConfig, DistributedConfig, MetricsConfig, WandbConfig, WatchdogConfig
from trainguard.config.training import ClippingConfig, DataConfig, SanitizeConfig
from trainguard.errors import ConfigError

__all__ = [
    "BLOCK", "FAULTS_REFUSED", "FAULT_TYPES", "SCALE_ONLY_STEPS", "PathStr", "LadderStep", "ConfigError",
    "PluginSpec", "NonfiniteConfig", "LossSpikeConfig", "LossTrendConfig", "GradNormConfig", "StragglerConfig",
    "ReplicaCheckConfig", "PeerReplayConfig", "AttentionEntropyConfig", "ActivationRangeConfig", "LocalizeConfig",
    "LossScaleConfig", "DetectorsConfig", "ClippingConfig", "SanitizeConfig", "SnapshotConfig", "CheckpointConfig",
    "RecoveryConfig", "WatchdogConfig", "DistributedConfig", "ChecksConfig", "WandbConfig", "MetricsConfig",
    "DataConfig", "FaultSpec", "TrainguardConfig",
    "parse_block", "read_json", "load", "block_of", "config_hash",
]
