"""Worker for test_ep_dedup.py, run as `torchrun --nproc_per_node 4 dedup_worker.py OUT_DIR`.

Four ranks as two "nodes" of two (LOCAL_WORLD_SIZE is set to 2 before the mesh is built: the node of a rank is
rank // 2, what the mesh reads on a real two-node job), one EP group of all four. Each rank builds the same
8-expert top-3 MoE layer (`layer_config`) behind the real `apply_ep` with the deduplicated dispatcher, per unit:
"node" (two stages: rails {0, 2} {1, 3}, blocks {0, 1} {2, 3}) and "rank" (one stage, fan-out on the expert's
rank), runs forward and backward on its own tokens for every scenario, and saves outputs, gradients and the pairs
it sent to each block as OUT_DIR/<unit>_<scenario>_<dtype>_rank<R>.safetensors for the test to compare against
one process. One world serves every case.
"""

import dataclasses
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import workers
from safetensors.torch import save_file

from moe_dist.config import load_config
from moe_dist.layers.moe import MoE
from moe_dist.models.decoder import build_model, materialize_whole
from moe_dist.parallel import mesh as mesh_module
from moe_dist.parallel.dedup import DedupAllToAllDispatcher
from moe_dist.parallel.expert_parallel import apply_ep
from moe_dist.parallel.tensor_parallel import apply_tp

sys.path.insert(0, str(Path(__file__).parent))  # loaded by path in the test: the sibling imports as under torchrun
from dispatch_worker import forward_backward  # noqa: E402
from dispatch_worker import layer_config as dispatch_layer_config  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOKENS = 12
# scenario -> extra model.moe overrides
SCENARIOS = {
    "spread": [],
    "capacity": ["model.moe.capacity_factor=1.0"],
    "node_limited": ["model.moe.n_groups=2", "model.moe.topk_groups=1", "model.moe.group_by=node"],
    "one_node": [],
    "no_tokens": [],
}
CASES = [(u, s, "fp32") for u in ("node", "rank") for s in SCENARIOS] + [("node", "spread", "bf16")]
# (dp, ep, tp, etp) = (2, 4, 2, 1): the TP pairs {0, 1} {2, 3} are the nodes and share their tokens (those of pair
# rank // 2), each rank dispatching its half to whole experts; the sum leaving the TP region assembles them.
FOLDED = ["spread", "capacity", "node_limited"]


def layer_config(scenario: str, dtype: str) -> list:
    """dispatch_worker's one-MoE-layer model with 8 experts, top-3, and the scenario's routing options."""
    return [*dispatch_layer_config(dtype), "model.moe.num_experts=8", "model.moe.top_k=3", *SCENARIOS[scenario]]


def scenario_inputs(scenario: str, rank: int, d_model: int) -> torch.Tensor:
    """(T, D) tokens of `rank`; the router is random (seed 0) except in one_node, where it prefers experts 4..6."""
    x = torch.randn(TOKENS, d_model, generator=torch.Generator().manual_seed(rank))
    if scenario == "no_tokens" and rank == 3:
        return x[:0]
    if scenario == "one_node":
        x[:, 4:7] += torch.tensor([8.0, 7.0, 6.0])
    return x


def prepare(moe: MoE, scenario: str) -> None:
    if scenario == "one_node":  # input dimension e picks expert e (node 1 holds experts 4..7)
        with torch.no_grad():
            moe.router.weight.zero_()
            moe.router.weight[:, :8] = 4.0 * torch.eye(8)


def run_case(out_dir: Path, mesh, unit: str, scenario: str, dtype: str) -> None:
    cfg = load_config(None, [*layer_config(scenario, dtype), "parallel.ep=4", "parallel.a2a_dedup=" + unit])
    model = materialize_whole(apply_ep(build_model(cfg.model), mesh), "cpu", seed=0).to(DTYPES[dtype])
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    assert isinstance(moe.dispatcher, DedupAllToAllDispatcher)
    prepare(moe, scenario)
    x = scenario_inputs(scenario, mesh.rank, cfg.model.d_model).to(DTYPES[dtype])
    tensors = forward_backward(moe, x)
    with torch.no_grad():  # the same dispatch once more, for the pairs it sends (every rank issues it)
        routing, _ = moe.router(x)
        _, _, state = moe.dispatcher.dispatch(x, routing)
    tensors["pairs_sent"] = torch.tensor(state.send_splits)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(out_dir / f"{unit}_{scenario}_{dtype}_rank{mesh.rank}.safetensors"),
    )


def run_folded_case(out_dir: Path, mesh, tp_group, scenario: str) -> None:
    cfg = load_config(None, [*layer_config(scenario, "fp32"), "parallel.ep=4", "parallel.a2a_dedup=node"])
    folded = dataclasses.replace(
        mesh, dp=2, dp_rank=mesh.rank // 2, tp=2, tp_rank=mesh.rank % 2, tp_group=tp_group, etp=1
    )
    model = apply_tp(materialize_whole(apply_ep(build_model(cfg.model), folded), "cpu", seed=0), folded)
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    assert isinstance(moe.dispatcher, DedupAllToAllDispatcher) and moe.dispatcher.split.gather is False
    tensors = forward_backward(moe, scenario_inputs(scenario, mesh.rank // 2, cfg.model.d_model))
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(out_dir / f"folded_{scenario}_rank{mesh.rank}.safetensors")
    )


def main(out_dir: Path) -> None:
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # two "nodes" of two ranks
    overrides = ["parallel.ep=4", "parallel.a2a_dedup=node", "train.global_batch_size=4", "train.micro_batch_size=1"]
    cfg = load_config(None, [*layer_config("spread", "fp32"), *overrides])
    mesh = workers.start_mesh(cfg, timeout_s=60)
    assert mesh.ep_dedup.blocks == 2 and mesh.ep_dedup.size == 2 and mesh.ep_dedup.index == mesh.rank // 2
    # "rank": blocks of one rank, the EP group as the rail (no group to create)
    by_rank = mesh_module._dedup_groups([[0, 1, 2, 3]], 2, "rank", mesh.rank, mesh.ep_group)
    meshes = {"node": mesh, "rank": dataclasses.replace(mesh, ep_dedup=by_rank)}
    for unit, scenario, dtype in CASES:
        run_case(out_dir, meshes[unit], unit, scenario, dtype)
    tp_group = next(
        g for g in (dist.new_group([0, 1]), dist.new_group([2, 3])) if mesh.rank in dist.get_process_group_ranks(g)
    )
    for scenario in FOLDED:
        run_folded_case(out_dir, mesh, tp_group, scenario)
    workers.finish(out_dir, mesh.rank)


if __name__ == "__main__":
    workers.run(main)
