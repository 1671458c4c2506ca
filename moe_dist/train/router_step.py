"""The routers' once-per-step state around a training step: the global-batch load from a routing pre-pass before
it (`route_step_ahead`), the balancing bias and load after it (`end_router_step`)."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from moe_dist.data.batches import Batch
from moe_dist.layers.moe import moe_routers
from moe_dist.parallel.comm import all_reduce_sum
from moe_dist.parallel.mesh import Mesh
from moe_dist.train.pipeline_step import moe_layer_index


@torch.no_grad()
def route_step_ahead(routers: list, forward: Callable[[Batch], list], batches: list, counted: bool) -> None:
    """`aux_loss_scope` global_batch with `global_batch_load` this_step: before the step's first forward with
    gradients, a no-grad forward of each of this rank's micro-batches of the step (the same batches in the same
    order as the training forwards, so every rank issues the same all-to-alls), of which only each MoE layer's
    assignments per expert before drops are kept. Summed over the micro-batches and all-reduced over the world
    (`counted` False on tensor-parallel peers of a counted rank: they routed the same tokens), they set every
    router's `load_E` to the step's f. `forward(batch)` returns the model's RoutingStats in layer order.

    The training forwards that follow route the same way (same weights and bias; `load_E` only enters the aux
    loss; the model's forward draws no random numbers), so this is the f of their own assignments, and the step's
    metrics count only theirs. Activation recompute wraps only forwards with gradients: none happens here. On a
    GPU whose kernels are not bitwise reproducible a near-tie could route differently in the two forwards; f is
    then off by that assignment, still the same on every rank. The counts stay on the device (no host sync)."""
    total_LE = None
    for batch in batches:
        counts_LE = torch.stack([s.tokens_per_expert_E.double() for s in forward(batch)])
        total_LE = counts_LE if total_LE is None else total_LE + counts_LE
    total_LE = all_reduce_sum(total_LE if counted else torch.zeros_like(total_LE))
    for router, counts_E in zip(routers, total_LE, strict=True):
        router.set_load(counts_E)


def end_router_step(model, layers: list[dict], update: bool, mesh: Optional[Mesh] = None) -> None:
    """Routers' once-per-optimizer-step state from the step's global expert load (all ranks and micro-batches,
    all-reduced, so every rank sets the same values; `update` False on a skipped step); the balancing bias, when
    used, goes into the step's record. A pipeline part's routers are its layers': the biases of every stage reach
    the record over the pipeline group (one sum of a layers × experts vector, the others' zeros)."""
    routers = moe_routers(model)
    mine = layers
    if mesh is not None and mesh.pp > 1:
        index = moe_layer_index(model.cfg)
        mine = [layers[index[int(k)]] for k in model.blocks if int(k) in index]
    for router, layer in zip(routers, mine, strict=True):
        if update:
            router.end_step(torch.tensor(layer["tokens_per_expert"], dtype=torch.float64))
        if router.bias_E is not None:
            layer["bias"] = router.bias_E.float().cpu().tolist()
    has_bias = model.cfg.moe.bias_update_rate > 0 or model.cfg.moe.choice_bias
    if mesh is not None and mesh.pp > 1 and has_bias and layers:  # alike on every rank
        bias = torch.tensor([layer.get("bias", [0.0] * len(layer["tokens_per_expert"])) for layer in layers])
        for layer, b in zip(layers, all_reduce_sum(bias.double(), mesh.pp_group).tolist(), strict=True):
            layer["bias"] = b  # fp32 values summed with zeros in fp64: exact
