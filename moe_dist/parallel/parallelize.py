"""The one ordered sequence that turns a single-device model into this rank's parallel shard."""

import copy

import torch
from torch import nn

from moe_dist.config import JobConfig
from moe_dist.parallel.expert_parallel import apply_ep
from moe_dist.parallel.mesh import Mesh
from moe_dist.parallel.pipeline import PipelinePart, apply_pp
from moe_dist.parallel.tensor_parallel import apply_tp, register_grad_sums, shard


def parallelize(model: nn.Module, mesh: Mesh, cfg: JobConfig) -> nn.Module:
    """Meta-device model → this rank's materialized shard. Every split acts on the meta model: experts over EP
    (only local experts remain), then the layer list over pipeline stages (this rank's PipelinePart), then
    dimensions over TP (shapes only); then `materialize_shards` allocates and initializes just this rank's shards
    on its device."""
    model = apply_ep(model, mesh, cfg.parallel.a2a_chunks)
    # Unsharded shapes of the whole model, on meta (no storage); the dispatchers (process groups) and DeepSpeed's
    # marker are shared.
    shared = [m.dispatcher for m in model.modules() if hasattr(m, "dispatcher")]
    shared += [m for m in model.modules() if m is getattr(model, "deepspeed_moe_marker", None)]
    template = copy.deepcopy(model, memo={id(x): x for x in shared})
    model = apply_pp(model, mesh, cfg)
    model = apply_tp(model, mesh, cfg.parallel.sequence_parallel)
    if isinstance(model, PipelinePart):
        model.sync_views()  # the stages see the modules TP replaced (the vocabulary-parallel embedding)
    materialize_shards(model, template, mesh, cfg.train.seed)
    if mesh.tp > 1:  # after allocation: the gradient sums' hooks belong to the allocated parameters
        register_grad_sums(model, mesh)
    return model


@torch.no_grad()
def materialize_shards(model: nn.Module, template: nn.Module, mesh: Mesh, seed: int) -> None:
    """Allocate `model`'s (meta, sharded) parameters on `mesh.device` and fill them with the values the whole
    model initialized from `seed` would have: for each init unit of the model (`Decoder.init_units`, in RNG order),
    its unsharded template is allocated on the CPU, initialized, sliced to this rank's shard of every parameter
    (`tp_dim`/`tp_parts`, set by apply_tp), copied to the device and freed. Peak extra host memory: one unit.

    Values are drawn on the CPU, as `materialize_whole` (the unsharded model on one device) does, so a seed gives the
    same model on every device and layout. Python attributes of the meta parameters (expert-group and TP marks)
    are carried over to the allocated ones. Units `model` does not hold (other pipeline stages' layers) are drawn
    too, and dropped: the random stream must reach the held units in the same state.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for path, init in template.init_units():
            whole = template.get_submodule(path)
            whole.to_empty(device="cpu")
            init(whole)
            try:
                target = model.get_submodule(path)
            except AttributeError:  # held by another pipeline stage
                whole.to_empty(device="meta")
                continue
            for name, full in whole.named_parameters():
                owner_path, _, leaf = name.rpartition(".")
                owner = target.get_submodule(owner_path) if owner_path else target
                meta = owner._parameters[leaf]
                dim = getattr(meta, "tp_dim", None)
                local = full if dim is None else shard(full, dim, mesh.tp_rank, mesh.tp, meta.tp_parts)
                # A slice is a fresh tensor and a whole one outlives the template's storage here: no further copy.
                p = nn.Parameter(local.to(mesh.device), requires_grad=meta.requires_grad)
                p.__dict__.update(vars(meta))
                owner._parameters[leaf] = p
            for name, buf in whole.named_buffers():  # replicated state (the routers' balancing buffers)
                owner_path, _, leaf = name.rpartition(".")
                owner = target.get_submodule(owner_path) if owner_path else target
                owner._buffers[leaf] = buf.to(mesh.device, copy=True)
            whole.to_empty(device="meta")  # frees the unit's unsharded CPU tensors
