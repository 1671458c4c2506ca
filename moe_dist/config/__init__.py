"""Job configuration: the schema (schema.py: the tree of dataclasses, each layer kind's section declared in its
layer file), strict loading from JSON and overrides (loading.py), the rules a config must satisfy (checks.py; the
parallel layout's in parallel_checks.py) and the generator of docs/config.md (doc.py). Imports run one way: errors
<- schema <- parallel_checks <- checks <- loading; doc reads the schema.

The names below are the public interface: `from moe_dist.config import load_config, ConfigError, JobConfig`, and
each layer kind's section by its class name (`from moe_dist.config import MoEConfig`). They are resolved when first
asked for: the layer files import `moe_dist.config.errors` while the schema gathers their sections, so this package
must not load the schema when it is itself imported.
"""

from importlib import import_module

from moe_dist.config.errors import ConfigError

_FROM = {
    "validate": "checks",
    "config_from_dict": "loading",
    "config_to_dict": "loading",
    "load_config": "loading",
    "parse_override": "loading",
    "check_global_batch": "parallel_checks",
    "check_layout": "parallel_checks",
    **dict.fromkeys(
        ("DataConfig", "DeepSpeedConfig", "JobConfig", "MixtureComponent", "ModelConfig", "ParallelConfig"), "schema"
    ),
    **dict.fromkeys(("PlanConfig", "TrainConfig"), "schema"),
}


def __getattr__(name: str):
    if name in _FROM:
        return getattr(import_module(f"moe_dist.config.{_FROM[name]}"), name)
    for kind in import_module("moe_dist.config.schema").layer_kinds():  # a kind's section, by its class name
        if kind.config is not None and kind.config.__name__ == name:
            return kind.config
    raise AttributeError(f"module 'moe_dist.config' has no attribute {name!r}")


__all__ = ["ConfigError", *_FROM]
