"""Worker for test_cp_mla.py, run as `torchrun --nproc_per_node 4 cp_mla_worker.py OUT_DIR`.

One world of 4 gloo ranks holds a CP group of 4 and two CP groups of 2 ({0, 1}, {2, 3}), as cp_attention_worker.py.
Every rank builds the same fp64 MLA layer, runs it once whole and single-process (the reference), and once on its own
pieces of the sequence through the latent-gathering context-parallel path, for every case (query bottleneck or full
rank, RoPE interleaved with YaRN or off, documents, prefix-LM) and both cp: outputs and input gradient of its own
positions, every weight gradient summed over the CP group, and the payload bytes of each kind of collective issued
(benchmarks/common.py's tracer).
"""

from pathlib import Path

import torch
import workers
from cp_attention_worker import sweep

from moe_dist.layers.mla import MLA, MLAConfig
from moe_dist.layers.rope import RopeScaling

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
    sweep(out_dir, CASES, build)


if __name__ == "__main__":
    workers.run(main)
