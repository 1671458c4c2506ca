"""The one ordered sequence that turns a single-device model into this rank's parallel shard."""

from torch import nn

from moe_dist.config import JobConfig
from moe_dist.models.decoder import materialize
from moe_dist.parallel.expert_parallel import apply_ep
from moe_dist.parallel.mesh import Mesh
from moe_dist.parallel.tensor_parallel import apply_tp


def parallelize(model: nn.Module, mesh: Mesh, cfg: JobConfig) -> nn.Module:
    """Meta-device model → this rank's materialized shard: experts split over EP (still on meta, so only local
    experts are allocated), allocate and initialize from the seed, then split over TP (slicing the initialized
    tensors keeps values independent of the layout; see tensor_parallel.py)."""
    model = materialize(apply_ep(model, mesh), mesh.device, cfg.train.seed)
    return apply_tp(model, mesh, cfg.parallel.sequence_parallel)
