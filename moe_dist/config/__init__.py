"""Job configuration: the schema (schema.py), strict loading from JSON and overrides (loading.py), the rules a
config must satisfy (checks.py; the parallel layout's in parallel_checks.py) and the generator of docs/config.md
(doc.py). Imports run one way: schema <- parallel_checks <- checks <- loading; doc reads the schema.

The names below are the public interface: `from moe_dist.config import load_config, ConfigError, JobConfig`.
"""

from moe_dist.config.checks import validate
from moe_dist.config.loading import config_from_dict, config_to_dict, load_config, parse_override
from moe_dist.config.parallel_checks import check_global_batch, check_layout
from moe_dist.config.schema import (
    AttentionConfig,
    ConfigError,
    DataConfig,
    DeepSpeedConfig,
    GDNConfig,
    JobConfig,
    Mamba2Config,
    MambaConfig,
    MixtureComponent,
    ModelConfig,
    MoEConfig,
    ParallelConfig,
    TrainConfig,
)

__all__ = [
    "AttentionConfig",
    "ConfigError",
    "DataConfig",
    "DeepSpeedConfig",
    "GDNConfig",
    "JobConfig",
    "Mamba2Config",
    "MambaConfig",
    "MixtureComponent",
    "ModelConfig",
    "MoEConfig",
    "ParallelConfig",
    "TrainConfig",
    "check_global_batch",
    "check_layout",
    "config_from_dict",
    "config_to_dict",
    "load_config",
    "parse_override",
    "validate",
]
