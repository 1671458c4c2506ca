"""The AMX grouped GEMM (moe_dist.kernels.grouped_gemm_cpu) against a per-expert fp64 loop: output and both
gradients, with experts of 0, 1, 31, 32, 33 rows (row blocks that end part-way), several widths and one expert with
every row; equal results at any thread count; its refusals; the "auto" choice of model.moe.impl.

Tolerance: at most twice the error of torch's grouped GEMM (`moe_dist.layers.moe.grouped_mm`) in bf16, plus a
small atol (DESIGN.md §6). Skipped where the CPU has no AMX-BF16 (the kernel's own reason is the skip reason).
"""

import pytest
import torch

from moe_dist.kernels import grouped_gemm_cpu
from moe_dist.layers import moe as moe_mod

pytestmark = pytest.mark.skipif(not grouped_gemm_cpu.cpu_has_amx(), reason="this CPU has no AMX-BF16")


def make(counts, d_in, d_out, seed=0):
    g = torch.Generator().manual_seed(seed)
    counts = torch.tensor(counts)
    R, E = int(counts.sum()), counts.shape[0]
    x = torch.randn(R, d_in, generator=g).to(torch.bfloat16)
    w = (torch.randn(E, d_in, d_out, generator=g) / d_in**0.5).to(torch.bfloat16)
    dy = torch.randn(R, d_out, generator=g).to(torch.bfloat16)
    return x, w, counts, dy


def reference(x, w, counts, dy):
    xs, dys = torch.split(x.double(), counts.tolist()), torch.split(dy.double(), counts.tolist())
    y = torch.cat([xs[e] @ w[e].double() for e in range(len(xs))])
    dx = torch.cat([dys[e] @ w[e].double().t() for e in range(len(xs))])
    dw = torch.stack([xs[e].t() @ dys[e] for e in range(len(xs))])
    return y, dx, dw


def run(fn, x, w, counts, dy):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fn(x, w, counts)
    return (y, *torch.autograd.grad(y, [x, w], dy))


def test_kernel_builds_on_a_cpu_with_amx():
    assert grouped_gemm_cpu.unavailable() is None


@pytest.mark.parametrize("counts, d_in, d_out", [
    ([32, 32], 32, 32),
    ([0, 1, 31, 32, 33], 64, 96),  # empty expert, single row, block tails on both sides of 32
    ([200], 96, 64),  # one expert: a dense GEMM with a tail block
    ([0, 0, 77, 0], 32, 128),  # all rows in one of four experts
    ([300, 5, 129], 512, 64),  # long K in the forward, units of several row blocks
    ([1000, 1100], 64, 32),  # long K in the weight gradient
    ([1100, 0, 700], 512, 64),  # several work units (512 KiB of rows) per expert: stores carried across units
])
def test_matches_a_per_expert_fp64_loop(counts, d_in, d_out):
    x, w, counts, dy = make(counts, d_in, d_out)
    want = reference(x, w, counts, dy)
    got = run(grouped_gemm_cpu.grouped_mm, x, w, counts, dy)
    torch_path = run(moe_mod.grouped_mm, x, w, counts, dy)
    for name, v, t, ref in zip(("y", "dx", "dw"), got, torch_path, want):
        assert v.dtype == torch.bfloat16 and v.shape == ref.shape, name
        assert ref.abs().sum() > 0, name
        err, torch_err = ((a.double() - ref).abs().max().item() for a in (v, t))
        assert err <= 2 * torch_err + 1e-3, (name, err, torch_err)


def test_experts_without_rows_get_zero_weight_gradients():
    x, w, counts, dy = make([0, 40, 0], 32, 32)
    _, _, dw = run(grouped_gemm_cpu.grouped_mm, x, w, counts, dy)
    assert dw[0].abs().sum() == 0 and dw[2].abs().sum() == 0 and dw[1].abs().sum() > 0


def test_no_rows_at_all():
    x, w, counts, dy = make([0, 0], 32, 64)
    y, dx, dw = run(grouped_gemm_cpu.grouped_mm, x, w, counts, dy)
    assert y.shape == (0, 64) and dx.shape == (0, 32) and dw.shape == (2, 32, 64) and dw.abs().sum() == 0


def test_same_bits_at_any_thread_count():
    x, w, counts, dy = make([100, 3, 64], 64, 64)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(grouped_gemm_cpu.grouped_mm, x, w, counts, dy)
        torch.set_num_threads(2)
        two = run(grouped_gemm_cpu.grouped_mm, x, w, counts, dy)
    finally:
        torch.set_num_threads(before)
    for a, b in zip(one, two):
        assert torch.equal(a, b)


def test_only_the_gradients_asked_for():
    x, w, counts, dy = make([40, 24], 32, 32)
    w = w.requires_grad_()
    y = grouped_gemm_cpu.grouped_mm(x, w, counts)  # x needs no gradient
    (dw,) = torch.autograd.grad(y, [w], dy)
    torch.testing.assert_close(dw.double(), reference(x, w.detach(), counts, dy)[2], rtol=0.02, atol=0.05)


def test_broadcast_output_gradient():
    x, w, counts, _ = make([10, 30], 32, 32)
    x = x.requires_grad_()
    y = grouped_gemm_cpu.grouped_mm(x, w, counts)
    (dx,) = torch.autograd.grad(y.sum(), [x])  # a stride-0 gradient
    want = reference(x.detach(), w, counts, torch.ones(40, 32, dtype=torch.bfloat16))[1]
    torch.testing.assert_close(dx.double(), want, rtol=0.02, atol=0.05)


@pytest.mark.parametrize("x, w, counts, message", [
    (torch.zeros(4, 32), torch.zeros(1, 32, 32), torch.tensor([4]), "bf16"),
    (torch.zeros(4, 48, dtype=torch.bfloat16), torch.zeros(1, 48, 32, dtype=torch.bfloat16), torch.tensor([4]),
     "multiples of 32"),
    (torch.zeros(4, 32, dtype=torch.bfloat16), torch.zeros(1, 64, 32, dtype=torch.bfloat16), torch.tensor([4]),
     r"\(R, I\) rows"),
    (torch.zeros(4, 32, dtype=torch.bfloat16), torch.zeros(2, 32, 32, dtype=torch.bfloat16), torch.tensor([1, 2]),
     "summing to 4"),
])
def test_refuses_what_it_cannot_compute(x, w, counts, message):
    with pytest.raises(ValueError, match=message):
        grouped_gemm_cpu.grouped_mm(x, w, counts)


def test_auto_takes_the_kernel_for_bf16_and_torch_otherwise(monkeypatch):
    calls = []
    real = grouped_gemm_cpu._GroupedMM.apply
    monkeypatch.setattr(grouped_gemm_cpu._GroupedMM, "apply", lambda *a: calls.append(a[0].dtype) or real(*a))
    mm = moe_mod.select_grouped_mm("auto")
    for dtype in (torch.bfloat16, torch.float32):
        x, w, counts, _ = make([20, 12], 32, 64)
        y = mm(x.to(dtype), w.to(dtype), counts)
        assert y.dtype == dtype
    assert calls == [torch.bfloat16]
    assert moe_mod.select_grouped_mm("torch") is moe_mod.grouped_mm


def test_cpu_choice_names_the_key_for_inputs_it_cannot_take():
    mm = moe_mod.select_grouped_mm("cpu")
    x, w, counts, _ = make([20, 12], 32, 64)
    with pytest.raises(ValueError, match=r"model.moe.impl='cpu': .*bf16"):
        mm(x.float(), w.float(), counts)


def test_moe_layer_with_the_kernel_matches_the_torch_layer():
    from moe_dist.config import MoEConfig

    layers = {}
    for impl in ("torch", "auto"):
        torch.manual_seed(0)
        layer = moe_mod.MoE(64, 96, MoEConfig(num_experts=4, top_k=2, d_ff=96, impl=impl), init_std=0.02, n_layers=2)
        layer.init_weights()
        layers[impl] = layer.to(torch.bfloat16)
    x = torch.randn(50, 64, dtype=torch.bfloat16)
    outs = {}
    for impl, layer in layers.items():
        xi = x.clone().requires_grad_()
        y, _ = layer(xi)
        outs[impl] = (y, *torch.autograd.grad(y.float().square().sum(), [xi, layer.experts.w13, layer.experts.w2]))
    for name, a, b in zip(("y", "dx", "dw13", "dw2"), outs["auto"], outs["torch"]):
        scale = b.double().abs().max()
        assert scale > 0 and (a.double() - b.double()).abs().max() <= 0.03 * scale, name


def unfused(x, w13, counts):
    from moe_dist.kernels import gated_silu_cpu

    return gated_silu_cpu.gated_silu(grouped_gemm_cpu.grouped_mm(x, w13, counts))


@pytest.mark.parametrize("counts, d_in, d_ff", [
    ([0, 1, 31, 32, 33], 64, 32),  # empty expert, single row, block tails: the pair's rows split 16 / rest
    ([300, 5, 129], 96, 96),  # gate and up panels three apart
    ([1100, 0, 700], 512, 64),  # several work units per expert: pending pairs carried across units
    ([8] * 40, 512, 256),  # 40 experts of 0.5 MiB packed weights: two runs of experts (SCRATCH_BYTES)
])
def test_gated_mode_has_the_bits_of_the_gemm_then_the_gated_silu(counts, d_in, d_ff):
    x, w13, counts, _ = make(counts, d_in, 2 * d_ff, seed=3)
    dh = torch.randn(x.shape[0], d_ff, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    got = run(grouped_gemm_cpu.grouped_mm_gated, x, w13, counts, dh)
    want = run(unfused, x, w13, counts, dh)
    for name, a, b in zip(("h", "dx", "dw13"), got, want):
        assert a.shape == b.shape and b.abs().sum() > 0, name
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), name


def test_gated_mode_refuses_a_hidden_size_that_is_not_a_multiple_of_32():
    x, w13, counts, _ = make([20, 12], 32, 96)  # F = 48
    assert "F = 48" in grouped_gemm_cpu.grouped_mm_gated_unsupported(x, w13, counts)
    with pytest.raises(ValueError, match="grouped_mm_gated: .*F = 48"):
        grouped_gemm_cpu.grouped_mm_gated(x, w13, counts)


def test_experts_take_the_gated_mode_for_bf16_under_auto_and_cpu_only(monkeypatch):
    calls = []
    real = grouped_gemm_cpu._GroupedGatedMM.apply
    monkeypatch.setattr(grouped_gemm_cpu._GroupedGatedMM, "apply", lambda *a: calls.append(a[0].dtype) or real(*a))
    x, w13, counts, _ = make([20, 12], 32, 64)
    w2 = w13[:, :, :32].transpose(1, 2).contiguous()  # (E, F, D)
    for impl in ("auto", "cpu", "torch"):
        swiglu = moe_mod.expert_swiglu("native", impl)
        for dtype in (torch.bfloat16, torch.float32) if impl == "auto" else (torch.bfloat16,):
            calls.clear()
            y = swiglu(x.to(dtype), w13.to(dtype), w2.to(dtype), counts)
            assert y.shape == x.shape and y.dtype == dtype
            assert calls == ([torch.bfloat16] if impl != "torch" and dtype == torch.bfloat16 else []), (impl, dtype)


def test_gated_mode_frees_gate_up_in_its_backward_and_says_so_on_a_second_one():
    x, w13, counts, _ = make([20, 12], 32, 64)
    x.requires_grad_()
    h = grouped_gemm_cpu.grouped_mm_gated(x, w13, counts)
    assert h.grad_fn.ab_R2F.shape == (32, 64)  # kept for the backward ...
    h.sum().backward(retain_graph=True)
    assert h.grad_fn.ab_R2F is None  # ... and dropped by it, before its GEMMs (peak memory as unfused)
    with pytest.raises(RuntimeError, match="retain_graph"):
        h.sum().backward()
