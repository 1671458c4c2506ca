"""Worker for test_cp_mla.py, run as `torchrun --nproc_per_node 4 cp_mla_worker.py OUT_DIR`.

One world of 4 gloo ranks holds a CP group of 4 and two CP groups of 2 ({0, 1}, {2, 3}), as cp_attention_worker.py.
Every rank builds the same fp64 MLA layer, runs it once whole and single-process (the reference), and once on its own
pieces of the sequence through the latent-gathering context-parallel path, for every case (query bottleneck or full
rank, RoPE interleaved with YaRN or off, documents, prefix-LM) and both cp: outputs and input gradient of its own
positions, every weight gradient summed over the CP group, and the payload bytes of each kind of collective issued
(benchmarks/common.py's tracer).
"""

import collections
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import workers
from cp_attention_worker import B, S, compare, documents, run

import moe_dist.layers.sdpa as sdpa
from moe_dist.layers.mla import MLA, MLAConfig
from moe_dist.layers.rope import RopeScaling
from moe_dist.parallel.context_parallel import seq_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from common import CollectiveTracer  # noqa: E402

D = 16
F64 = torch.float64
SHAPES = dict(n_heads=4, kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=3)
YARN = RopeScaling(type="yarn", factor=4.0, original_max_position_embeddings=8, mscale=0.707, mscale_all_dim=1.0)
CASES = {  # name: (MLAConfig arguments, documents, prefix)
    "q_lora_yarn": (dict(q_lora_rank=5, rope_interleave=True, rope_scaling=YARN), False, False),
    "full_q_documents": (dict(), True, False),
    "q_lora_prefix": (dict(q_lora_rank=5, rope_interleave=True, mask="prefix"), True, True),
    "norope_documents": (dict(rope=False), True, False),
}


def build(kwargs: dict) -> MLA:
    layer = MLA(D, MLAConfig(**SHAPES, **kwargs), init_std=0.02, n_layers=2)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # O(1) weights: the softmax is far from uniform, every term matters
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=F64) * 0.5)
    return layer.double()


def main(out_dir: Path) -> None:
    rank = workers.start()
    groups = {4: dist.new_group([0, 1, 2, 3]), 2: [dist.new_group([0, 1]), dist.new_group([2, 3])]}
    sdpa.BLOCK_SCORES = B * 4 * S * 3  # 3-query blocks (ragged: pieces are 4 or 8 long)
    ids, prefix = documents()
    results = {}
    for name, (kwargs, docs, pfx) in CASES.items():
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


if __name__ == "__main__":
    workers.run(main)
