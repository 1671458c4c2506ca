"""Each tensor-parallel layer (tp = 2, two gloo ranks under torchrun; with and without sequence parallelism) against
its single-device version, forward and backward: outputs, input gradients and every parameter's gradient (sharded
ones against the matching slice)."""

from pathlib import Path

import pytest
import torch
from support import worker_results

from moe_dist.parallel.tensor_parallel import shard, shard_ranges, unshard

WORKER = Path(__file__).with_name("tp_worker.py")
LAYERS = ["attention", "mamba", "swiglu", "moe", "model"]
# Jamba's inner norms with an untied head; plain Mamba with a tied head; the first with sequence parallelism; the
# MoE recipes (sigmoid scores, bias, groups, sequence aux loss, gated shared experts); squared-ReLU FFNs (dense,
# experts split over TP, shared expert), and with whole experts (etp = 1) and sequence parallelism
VARIANTS = ["norms_untied", "plain_tied", "sp_norms_untied", "moe_recipes", "relu2", "sp_relu2_whole"]
# Mamba-2 and Gated DeltaNet layers: one B/C group (fewer than the ranks) with an untied head; four groups with
# sequence parallelism
SSM_LAYERS = ["mamba2", "gateddeltanet", "swiglu", "moe", "model"]
SSM_VARIANTS = ["ssm_groups1_untied", "sp_ssm_groups4"]
# MLA with the query bottleneck (RoPE interleaved, YaRN); with a full-rank query under sequence parallelism
MLA_LAYERS = ["mla", "swiglu", "moe", "model"]
MLA_VARIANTS = ["mla_q_lora", "sp_mla_full_q"]
CASES = [(v, layer) for v in VARIANTS for layer in LAYERS] + [(v, layer) for v in SSM_VARIANTS for layer in SSM_LAYERS]
CASES += [(v, layer) for v in MLA_VARIANTS for layer in MLA_LAYERS]


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory, forks) -> list[dict]:
    return worker_results(WORKER, tmp_path_factory.mktemp("tp"), forks=forks)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant, layer", CASES)
def test_tensor_parallel_layer_matches_single_device(tp_results, layer, variant):
    for rank, results in enumerate(tp_results):
        entries = {k: v for k, v in results.items() if k.startswith(f"{variant}.{layer}.")}
        assert f"{variant}.{layer}.out" in entries or layer == "model"
        assert sum(".grad." in k for k in entries) >= 2, f"no gradients compared for {layer}"
        for name, e in entries.items():
            assert e["err"] <= 1e-4 * e["scale"] + 1e-12, (
                f"rank {rank} {name}: max |diff| {e['err']:.3g} vs reference magnitude {e['scale']:.3g}"
            )


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant", VARIANTS + SSM_VARIANTS + MLA_VARIANTS)
def test_packed_documents_stay_apart_under_tp_and_sp(tp_results, variant):
    """Dropless MoE, fp32: the sharded logits of packed documents equal the single-device ones, and changing one
    document moves no logit of another document by more than 1e-6."""
    for rank, results in enumerate(tp_results):
        single, other, changed = (results[f"{variant}.documents.{k}"] for k in ("vs_single", "other", "changed"))
        assert single["err"] <= 1e-4 * single["scale"] + 1e-12, (rank, single)
        assert other["err"] < 1e-6, (rank, other)
        assert changed["err"] > 1e-3, (rank, changed)  # the changed document did change


@pytest.mark.parametrize("parts", [1, 2, (2, 4, 2)])
def test_shard_and_unshard_are_inverse(parts):
    full = torch.arange(4 * 8 * 3).view(4, 8, 3)
    pieces = [shard(full, 1, r, 2, parts) for r in range(2)]
    assert all(p.shape == (4, 4, 3) for p in pieces)
    torch.testing.assert_close(unshard(pieces, 1, parts), full)
    if parts == 2:  # each half of the dim is split on its own: rank 0 holds the first quarter of both halves
        torch.testing.assert_close(pieces[0], torch.cat([full[:, 0:2], full[:, 4:6]], dim=1))
    if parts == (2, 4, 2):  # blocks of given sizes (Mamba-2's in_proj components), each split on its own
        torch.testing.assert_close(pieces[1], torch.cat([full[:, 1:2], full[:, 4:6], full[:, 7:8]], dim=1))
        assert shard_ranges(8, 1, 2, parts) == [(1, 2), (4, 6), (7, 8)]  # what a checkpoint read slices
