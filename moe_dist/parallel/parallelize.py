"""The one ordered sequence that turns a single-device model into this rank's parallel shard."""

from torch import nn

from moe_dist.config import JobConfig
from moe_dist.parallel.expert_parallel import apply_ep
from moe_dist.parallel.mesh import Mesh


def parallelize(model: nn.Module, mesh: Mesh, cfg: JobConfig) -> nn.Module:
    """Apply tensor parallelism (not yet implemented: parallel.tp must be 1), then expert parallelism."""
    return apply_ep(model, mesh)
