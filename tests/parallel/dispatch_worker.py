"""Worker for test_ep_dispatch.py, run as `torchrun --nproc_per_node 2 dispatch_worker.py OUT_DIR`.

Each rank builds the same 4-expert MoE layer (`layer_config(dtype)`: fp32 at d_model 8, or bf16 at d_model 32),
keeps its expert shard behind the all-to-all dispatcher (the real `apply_ep`), runs forward and backward on its
own tokens for every scenario and dtype, and again through the chunked dispatcher (`CHUNKS`), runs the uneven TP
row collectives, and saves its outputs and gradients as OUT_DIR/<case>_rank<R>.safetensors (`case_name`) for the
test to compare against one process. The same world then serves as (dp, ep, tp, etp) = (1, 2, 2, 1), expert
parallelism folded across TP (the EP group is the TP group: both ranks hold the same tokens, each dispatches its
half to whole experts), for the folded scenarios (OUT_DIR/folded_<scenario>_<dtype>_rank<R>.safetensors). One
world serves every case: its start-up costs more than all the cases together.
"""

import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist
import workers
from safetensors.torch import save_file

from moe_dist.config import load_config
from moe_dist.layers.moe import MoE
from moe_dist.models.decoder import build_model, materialize_whole
from moe_dist.parallel.comm import gather_rows, reduce_scatter_rows
from moe_dist.parallel.expert_parallel import apply_ep
from moe_dist.parallel.tensor_parallel import apply_tp

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SCENARIOS = ["all_to_other_rank", "rank_routes_nothing_locally", "rank_has_no_tokens"]


def layer_config(dtype: str) -> list:
    """Config overrides of the one-MoE-layer model; bf16 at sizes torch's grouped GEMM takes (16-byte rows)."""
    size = ["model.d_model=8", "model.d_ff=16"] if dtype == "fp32" else ["model.d_model=32", "model.d_ff=32"]
    return [
        *size,
        "model.n_layers=1",
        "model.mixer_pattern=A",
        "model.attention.n_heads=2",
        "model.attention.n_kv_heads=2",
        "model.moe.num_experts=4",
        "model.moe.top_k=2",
        "model.moe.capacity_factor=null",
    ]


def scenario_inputs(scenario: str, rank: int, d_model: int = 8) -> torch.Tensor:
    """(T, D) tokens. The router weight is set to pick expert e for inputs large in dimension e."""
    x = torch.zeros(6, d_model)
    if scenario == "all_to_other_rank":
        # rank 0's tokens all prefer experts 2, 3 (held by rank 1); rank 1's too: rank 0 receives nothing,
        # experts 0 and 1 get no token at all.
        x[:, 2], x[:, 3] = 3.0, 2.0 + 0.1 * torch.arange(6)
    elif scenario == "rank_has_no_tokens":
        # rank 1's micro-batch is empty: it routes nothing but still takes part in both all-to-alls
        if rank == 1:
            return torch.zeros(0, d_model)
        x[:, 2], x[:, 3] = 3.0, 2.0 + 0.1 * torch.arange(6)
    elif scenario == "rank_routes_nothing_locally":
        # rank r sends everything to the other rank's experts
        other = 1 - rank
        x[:, 2 * other], x[:, 2 * other + 1] = 3.0, 2.0 + 0.1 * torch.arange(6)
    return x + 0.01 * torch.randn(6, d_model, generator=torch.Generator().manual_seed(rank))


# The chunked dispatch (dispatch.py, chunks > 1) on every scenario, fp32: 2 and 3 chunks cut the 6 tokens evenly
# (3 and 2 per chunk), 4 unevenly (2, 1, 2, 1) and 8 leaves chunks 3 and 7 empty on every rank (⌊t · 8 / 6⌋).
CHUNKS = [2, 3, 4, 8]


def case_name(scenario: str, dtype: str, chunks: int) -> str:
    return f"{scenario}_{dtype}" + (f"_chunks{chunks}" if chunks > 1 else "")


def _config(dtype: str):
    return load_config(
        None,
        [
            *layer_config(dtype),
            "parallel.ep=2",
            "train.global_batch_size=4",
            "train.micro_batch_size=2",
            "train.eval_batches=2",
        ],
    )


def route_by_dimension(moe: MoE) -> None:
    """Router weights that send an input large in dimension e to expert e (what the scenarios' inputs rely on)."""
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[:, :4] = 4.0 * torch.eye(4)


def forward_backward(moe: MoE, x: torch.Tensor) -> dict:
    """Output, input, router and expert gradients of a fixed weighted sum of the layer's output; `sent_bytes`."""
    x = x.requires_grad_()
    out, stats = moe(x)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return {
        "out": out.detach(),
        "x_grad": x.grad,
        "router_grad": moe.router.weight.grad.clone(),
        "sent_bytes": torch.tensor(float(stats.sent_bytes)),
        **{f"{n}_grad": getattr(moe.experts, n).grad for n in ("w13", "w2")},
    }


def run_case(out_dir: Path, mesh, scenario: str, dtype: str, chunks: int = 1) -> None:
    cfg = _config(dtype)
    model = materialize_whole(apply_ep(build_model(cfg.model), mesh, chunks), "cpu", seed=0).to(DTYPES[dtype])
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    assert moe.dispatcher.chunks == chunks
    route_by_dimension(moe)
    tensors = forward_backward(moe, scenario_inputs(scenario, mesh.rank, cfg.model.d_model).to(DTYPES[dtype]))
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(out_dir / f"{case_name(scenario, dtype, chunks)}_rank{mesh.rank}.safetensors"),
    )


FOLDED_SCENARIOS = ["all_to_one_rank", "one_slice_empty", "no_tokens"]


def folded_inputs(scenario: str, d_model: int = 8) -> torch.Tensor:
    """(T, D) tokens, the same on both TP ranks; rank s dispatches the s-th half of them.

    all_to_one_rank: every token prefers experts 2, 3 (rank 1's): rank 0 receives nothing and its experts get no
    token; one_slice_empty: a single token (slice 1 is empty: rank 1 dispatches nothing), to rank 0's experts;
    no_tokens: an empty micro-batch, every all-to-all still issued."""
    n = {"all_to_one_rank": 6, "one_slice_empty": 1, "no_tokens": 0}[scenario]
    x = torch.zeros(n, d_model)
    first = 0 if scenario == "one_slice_empty" else 2
    x[:, first], x[:, first + 1] = 3.0, 2.0 + 0.1 * torch.arange(n)
    return x + 0.01 * torch.randn(n, d_model, generator=torch.Generator().manual_seed(0))


def run_folded_case(out_dir: Path, mesh, scenario: str, dtype: str, chunks: int = 1) -> None:
    """The MoE layer under apply_ep then apply_tp with whole experts (etp = 1) on the 2-rank EP group as TP group,
    through the chunked dispatcher when `chunks` > 1."""
    folded = dataclasses.replace(mesh, dp=1, dp_rank=0, tp=2, tp_rank=mesh.rank, tp_group=mesh.ep_group, etp=1)
    cfg = _config(dtype)
    model = materialize_whole(apply_ep(build_model(cfg.model), folded, chunks), "cpu", seed=0).to(DTYPES[dtype])
    model = apply_tp(model, folded)
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    assert not hasattr(moe.experts.w13, "tp_dim") and moe.dispatcher.split.gather is False  # whole experts
    assert moe.dispatcher.chunks == chunks
    route_by_dimension(moe)
    tensors = forward_backward(moe, folded_inputs(scenario, cfg.model.d_model).to(DTYPES[dtype]))
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(out_dir / f"folded_{case_name(scenario, dtype, chunks)}_rank{mesh.rank}.safetensors"),
    )


ROW_SIZES = {"uneven": [3, 1], "one_empty": [0, 2], "all_empty": [0, 0]}


def row_inputs(sizes: list[int], rank: int) -> torch.Tensor:
    """Rank r's rows for the uneven TP row collectives: values that name (rank, row, column)."""
    n = sizes[rank]
    return 100.0 * rank + 10.0 * torch.arange(n).view(n, 1) + torch.arange(4.0).view(1, 4)


def run_row_collectives(out_dir: Path, rank: int) -> None:
    """gather_rows and reduce_scatter_rows over the world (as a TP group) with uneven and empty blocks, with the
    gradients of a weighted sum of their outputs."""
    for case, sizes in ROW_SIZES.items():
        x = row_inputs(sizes, rank).requires_grad_()
        gathered = gather_rows(x, sizes, dist.group.WORLD)
        ((gathered * (rank + 1.0)).sum()).backward()
        y = torch.arange(sum(sizes) * 4.0).view(-1, 4).mul(rank + 1.0).requires_grad_()
        scattered = reduce_scatter_rows(y, sizes, dist.group.WORLD)
        (scattered * 2.0).sum().backward()
        tensors = {"gathered": gathered.detach(), "x_grad": x.grad, "scattered": scattered.detach(), "y_grad": y.grad}
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / f"rows_{case}_rank{rank}.safetensors"))


def main(out_dir: Path) -> None:
    mesh = workers.start_mesh(_config("fp32"), timeout_s=60)
    for dtype in DTYPES:
        for scenario in SCENARIOS:
            run_case(out_dir, mesh, scenario, dtype)
        for scenario in FOLDED_SCENARIOS:
            run_folded_case(out_dir, mesh, scenario, dtype)
    for chunks in CHUNKS:
        for scenario in SCENARIOS:
            run_case(out_dir, mesh, scenario, "fp32", chunks)
        for scenario in FOLDED_SCENARIOS:
            run_folded_case(out_dir, mesh, scenario, "fp32", chunks)
    run_row_collectives(out_dir, mesh.rank)
    workers.finish(out_dir, mesh.rank)


if __name__ == "__main__":
    workers.run(main)
