"""Worker for test_cp_recurrent.py, run as `torchrun --nproc_per_node 4 cp_recurrent_worker.py OUT_DIR`.

Every rank builds the same tiny recurrent mixer (Mamba-1, Mamba-2, Gated DeltaNet; fp64), runs the whole sequence
in one process (the reference: the mixer without a shard), then its local pieces with a SeqShard over a CP group
of 2 (ranks {0, 1} and {2, 3}) or 4, and compares outputs, the input's gradient and every parameter's gradient
(summed over the CP group) with the reference. Documents off and on; the document ids put a boundary exactly at a
piece edge, make a piece one whole document, and start a document inside a piece; with cp = 4 the pieces (2 or 1
positions) are shorter than d_conv − 1 = 3. Then tp = 2 × cp = 2 (`tp_times_cp`). Each rank writes
OUT_DIR/rank<R>.json: {case: [max output error, max input-gradient error, max parameter-gradient error, max
reference magnitude]}. One world runs every case.
"""

from pathlib import Path

import torch
import torch.distributed as dist
import workers

from moe_dist.config import GDNConfig, Mamba2Config, MambaConfig
from moe_dist.layers.gdn import GatedDeltaNet
from moe_dist.layers.mamba import Mamba
from moe_dist.layers.mamba2 import Mamba2
from moe_dist.parallel import tensor_parallel as tpm
from moe_dist.parallel.context_parallel import seq_shard
from moe_dist.parallel.mesh import Mesh

D_MODEL, BATCH = 8, 2
# Document starts: row 0 at 4, 8, 13; row 1 at 6 (cut to the sequence length).
DOCS = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 3], [0] * 6 + [1] * 10])


def build(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "mamba":
        layer = Mamba(D_MODEL, MambaConfig(d_state=4, chunk_size=4, impl="torch"), 1e-5, 0.3)
    elif kind == "mamba2":
        cfg = Mamba2Config(d_state=4, head_dim=4, n_groups=2, chunk_size=4, impl="torch")
        layer = Mamba2(D_MODEL, cfg, 1e-5, 0.3)
    else:
        cfg = GDNConfig(n_k_heads=2, n_v_heads=4, head_k_dim=4, head_v_dim=4, chunk_size=4, impl="torch")
        layer = GatedDeltaNet(D_MODEL, cfg, 1e-5, 0.3)
    layer.init_weights()
    with torch.no_grad():  # larger steps than the init's, so states decay visibly within a piece
        for name, p in layer.named_parameters():
            if "bias" in name and ("dt" in name):
                p.add_(2.0)
    return layer.double()


def run(layer, x, weight, **kw):
    """Forward, loss Σ out · weight, backward: output, input gradient, parameter gradients."""
    layer.zero_grad()
    x = x.detach().requires_grad_()
    out = layer(x, **kw)
    (out * weight).sum().backward()
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}


def tp_times_cp(rank: int) -> dict:
    """tp = 2 × cp = 2 (tp innermost: TP groups {0, 1} {2, 3}, CP groups {0, 2} {1, 3}): the mixers split over TP
    by the real sharding (each kind's TP rule), run with a shard; parameter gradients summed over
    CP, then gathered over TP into full tensors, against the whole unsplit mixer in one process."""
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp_group, cp_group = tp_groups[rank // 2], cp_groups[rank % 2]
    mesh = Mesh(
        rank, 4, rank, 4, torch.device("cpu"), 2, rank // 2, 1, 0, None, None, "ep_size_1", 2, rank % 2, tp_group
    )
    split = tpm.tensor_split(mesh)
    results = {}
    seqlen = 16
    g = torch.Generator().manual_seed(seqlen)
    x = torch.randn(BATCH, seqlen, D_MODEL, generator=g, dtype=torch.float64)
    weight = torch.randn(BATCH, seqlen, D_MODEL, generator=g, dtype=torch.float64)
    shard = seq_shard(cp_group, 2, rank // 2, seqlen)
    for kind in ("mamba", "mamba2", "gdn"):
        whole, layer = build(kind), build(kind)
        tpm.split_sublayer(layer, split)
        tpm.register_grad_sums(layer, mesh)
        for docs in (None, DOCS[:, :seqlen]):
            ref_out, ref_dx, ref_grads = run(whole, x, weight, document_ids=docs)
            out, dx, grads = run(layer, shard.local(x), shard.local(weight), document_ids=docs, shard=shard)
            param_err = 0.0
            for name, p in layer.named_parameters():
                dist.all_reduce(grads[name], group=cp_group)
                if hasattr(p, "tp_dim"):
                    grads[name] = tpm.gather_shards(grads[name], tp_group, p.tp_dim, p.tp_parts)
                param_err = max(param_err, (grads[name] - ref_grads[name]).abs().max().item())
            results[f"{kind}_tp2_cp2_s{seqlen}_{'docs' if docs is not None else 'nodocs'}"] = [
                (out - shard.local(ref_out)).abs().max().item(),
                (dx - shard.local(ref_dx)).abs().max().item(),
                param_err,
                ref_out.abs().max().item(),
            ]
    return results


def main(out_dir: Path) -> None:
    rank = workers.start()
    groups = {2: [dist.new_group([0, 1]), dist.new_group([2, 3])], 4: [dist.new_group([0, 1, 2, 3])]}
    results = {}
    for kind in ("mamba", "mamba2", "gdn"):
        layer = build(kind)
        for cp, seqlen in ((2, 16), (4, 16), (4, 8)):
            group = groups[cp][rank // cp]
            shard = seq_shard(group, cp, rank % cp, seqlen)
            g = torch.Generator().manual_seed(seqlen)
            x = torch.randn(BATCH, seqlen, D_MODEL, generator=g, dtype=torch.float64)
            weight = torch.randn(BATCH, seqlen, D_MODEL, generator=g, dtype=torch.float64)
            for docs in (None, DOCS[:, :seqlen]):
                ref_out, ref_dx, ref_grads = run(layer, x, weight, document_ids=docs)
                out, dx, grads = run(layer, shard.local(x), shard.local(weight), document_ids=docs, shard=shard)
                for grad in grads.values():
                    dist.all_reduce(grad, group=group)
                param_err = max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads)
                results[f"{kind}_cp{cp}_s{seqlen}_{'docs' if docs is not None else 'nodocs'}"] = [
                    (out - shard.local(ref_out)).abs().max().item(),
                    (dx - shard.local(ref_dx)).abs().max().item(),
                    param_err,
                    ref_out.abs().max().item(),
                ]
    results.update(tp_times_cp(rank))
    workers.finish(out_dir, rank, results)


if __name__ == "__main__":
    workers.run(main)
