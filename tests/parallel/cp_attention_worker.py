"""Worker for test_cp_attention.py, run as `torchrun --nproc_per_node 4 cp_attention_worker.py OUT_DIR`.

One world of 4 gloo ranks holds a CP group of 4 and two CP groups of 2 ({0, 1}, {2, 3}). Every rank builds the
same fp64 attention layer (same seed), runs it once whole and single-process (the reference), and once on its own
pieces of the sequence through the layer's context-parallel path, for every case (mask kind, GQA, documents) and
both cp. It records, per compared tensor, the largest absolute difference from the reference and the reference's
largest magnitude: the outputs and input gradient of its own positions, and every weight gradient summed over the
CP group (each rank's weights see only its own queries' loss; the sum is the whole sequence's gradient).
The query-block loop of the SDPA path is forced to ragged 3-query blocks (BLOCK_SCORES), so it is exercised.
It also records the payload bytes of each kind of collective the CP forward and backward issued, as
benchmarks/comm_report.py counts them (benchmarks/common.py's tracer).
"""

import collections
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import workers

import moe_dist.layers.sdpa as sdpa
from moe_dist.config import AttentionConfig
from moe_dist.layers.attention import Attention
from moe_dist.parallel.context_parallel import seq_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from common import CollectiveTracer  # noqa: E402

B, S, D = 2, 32, 16
F64 = torch.float64
# S = 32: pieces of 8 positions at cp = 2, of 4 at cp = 4. Row 0: boundaries at 5, 8 (a piece edge at both cp),
# 12 (an edge at cp = 4), 16, 24; positions 16..23 are one whole document (one piece at cp = 2, two at cp = 4)
# and 8..11 too at cp = 4. Row 1: one document over the first 19 positions, then one to the end.
DOC_STARTS = [[0, 5, 8, 12, 16, 24], [0, 19]]
PROMPT = 3  # prefix-LM: the first 3 tokens of each document are its prompt

CASES = {  # name: (AttentionConfig arguments, documents, prefix)
    "causal": (dict(n_heads=4, n_kv_heads=4), False, False),
    "causal_gqa": (dict(n_heads=4, n_kv_heads=2), False, False),
    "window_gqa": (dict(n_heads=4, n_kv_heads=1, sliding_window=6), False, False),
    "documents_gqa": (dict(n_heads=4, n_kv_heads=2), True, False),
    "prefix_gqa": (dict(n_heads=4, n_kv_heads=2, mask="prefix"), True, True),
    "window_documents": (dict(n_heads=2, n_kv_heads=2, sliding_window=5), True, False),
    "window_prefix_gqa": (dict(n_heads=4, n_kv_heads=2, sliding_window=5, mask="prefix"), True, True),
    # Qwen3-Next-style extras: per-head q/k norms, output gate, partial RoPE, softmax scale, q/k/v biases
    "recipes_documents": (
        dict(
            n_heads=4,
            n_kv_heads=2,
            qk_norm="head",
            output_gate=True,
            rope_fraction=0.5,
            softmax_scale=0.3,
            qkv_bias=True,
        ),
        True,
        False,
    ),
    "full_norm_norope": (dict(n_heads=4, n_kv_heads=2, qk_norm="full", rope=False), False, False),
}


def documents() -> tuple[torch.Tensor, torch.Tensor]:
    """(B, S) document ids and prompt flags of DOC_STARTS."""
    ids = torch.zeros(B, S, dtype=torch.long)
    prefix = torch.zeros(B, S, dtype=torch.bool)
    for b, starts in enumerate(DOC_STARTS):
        for d, (s, e) in enumerate(zip(starts, starts[1:] + [S])):
            ids[b, s:e] = 10 + d
            prefix[b, s : min(e, s + PROMPT)] = True
    return ids, prefix


def build(kwargs: dict) -> Attention:
    layer = Attention(D, AttentionConfig(**kwargs), init_std=0.02, n_layers=2)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # O(1) weights: the softmax is far from uniform, every term matters
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=F64) * 0.5)
    return layer.double()


def run(layer, x, cot, shard=None, **masks):
    """Output and gradients (input, every parameter) of sum(layer(x) · cot)."""
    layer.zero_grad()
    x = x.clone().requires_grad_(True)
    out = layer(x, shard=shard, **masks)
    (out * cot).sum().backward()
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}


def compare(got: torch.Tensor, ref: torch.Tensor) -> dict:
    return {"err": (got - ref).abs().max().item(), "scale": ref.abs().max().item()}


def sweep(out_dir: Path, cases: dict, build) -> None:
    """Every case of `cases` (name: (layer arguments, documents, prefix)), its layer from `build(arguments)`, whole
    against cp = 2 and 4; the results go to OUT_DIR/rank<R>.json (cp_mla_worker.py runs its layer through this too)."""
    rank = workers.start()
    groups = {4: dist.new_group([0, 1, 2, 3]), 2: [dist.new_group([0, 1]), dist.new_group([2, 3])]}
    sdpa.BLOCK_SCORES = B * 4 * S * 3  # 3-query blocks (ragged: pieces are 4 or 8 long)
    ids, prefix = documents()
    results = {}
    for name, (kwargs, docs, pfx) in cases.items():
        layer = build(kwargs)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(B, S, D, generator=g, dtype=F64)
        cot = torch.randn(B, S, D, generator=g, dtype=F64)
        masks = {"document_ids": ids if docs else None, "prefix": prefix if pfx else None}
        ref_out, ref_dx, ref_dw = run(layer, x, cot, **masks)
        for cp in (2, 4):
            group = groups[4] if cp == 4 else groups[2][rank // 2]
            shard = seq_shard(group, cp, rank % cp, S)
            payload = collections.Counter()
            with CollectiveTracer(lambda c, seen=payload: seen.update({c.kind: c.payload_bytes})):
                out, dx, dw = run(layer, shard.local(x), shard.local(cot), shard, **masks)
            results[f"{name}.cp{cp}.payload"] = dict(payload)
            results[f"{name}.cp{cp}.out"] = compare(out, shard.local(ref_out))
            results[f"{name}.cp{cp}.grad.x"] = compare(dx, shard.local(ref_dx))
            for n, grad in dw.items():
                dist.all_reduce(grad, group=group)
                results[f"{name}.cp{cp}.grad.{n}"] = compare(grad, ref_dw[n])
    workers.finish(out_dir, rank, results)


def main(out_dir: Path) -> None:
    sweep(out_dir, CASES, build)


if __name__ == "__main__":
    workers.run(main)
