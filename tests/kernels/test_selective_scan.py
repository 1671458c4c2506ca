"""Triton selective scan against `selective_scan_ref` in fp64: output and the gradient of every input, with and
without D / z / delta_bias / softplus, awkward sizes (1, 7, 100 in batch, channels, length and state), fp32 and
half-precision inputs; then the Mamba layer running on it.

Runs under TRITON_INTERPRET=1 or MOE_DIST_KERNEL_DEVICE=cuda (see conftest.py). The PyTorch path it must stay
within twice the error of is the reference itself run on the same (low-precision) inputs and device. The
interpreter executes `tl.associative_scan` element by element, so CPU shapes stay small.
"""

import os

import pytest
import torch
from moe_dist.kernels.reference import selective_scan_ref
from moe_dist.kernels.selective_scan import selective_scan

from moe_dist.config import MambaConfig
from moe_dist.layers.mamba import Mamba

ON_CUDA = os.environ.get("MOE_DIST_KERNEL_DEVICE") == "cuda"
F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")

# (batch, dim, seqlen, state): one step, one channel, one state; ragged chunk tails; several channel blocks.
SHAPES = [(2, 3, 100, 4), (1, 1, 1, 3), (1, 7, 7, 1), (1, 100, 7, 2)]
if ON_CUDA:  # realistic Mamba sizes: many chunks, many channel blocks, state 16
    SHAPES += [(2, 64, 1000, 16), (1, 512, 2048, 16)]


def inputs(shape, dtype, device, full=True, param_dtype=F32, seed=0):
    """Tensors named as the scan's arguments; Δ positive before the optional softplus as in a trained model."""
    batch, dim, seqlen, state = shape
    g = torch.Generator().manual_seed(seed)
    x = dict(
        u=torch.randn(batch, dim, seqlen, generator=g),
        delta=(
            torch.randn(batch, dim, seqlen, generator=g) * 0.5 if full else torch.rand(batch, dim, seqlen, generator=g)
        ),
        A=-(torch.rand(dim, state, generator=g) * 2 + 0.1),
        B=torch.randn(batch, state, seqlen, generator=g),
        C=torch.randn(batch, state, seqlen, generator=g),
    )
    x = {k: v.to(dtype) for k, v in x.items()}
    x["A"] = x["A"].float()
    if full:
        x.update(
            D=torch.randn(dim, generator=g).to(param_dtype),
            z=torch.randn(batch, dim, seqlen, generator=g).to(dtype),
            delta_bias=(torch.randn(dim, generator=g) * 0.5 - 1.0).to(param_dtype),
        )
    grad = torch.randn(batch, dim, seqlen, generator=g).to(dtype)
    return {k: v.to(device) for k, v in x.items()}, grad.to(device)


def run(fn, x, grad, **kw):
    """(out, {name: grad}) of fn, with fresh leaves."""
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in x.items()}
    out = fn(**leaves, **kw)
    out.backward(grad.to(out.dtype))
    return out.detach(), {k: v.grad for k, v in leaves.items()}


def check(shape, dtype, device, within_torch_error, full=True, softplus=True, param_dtype=F32):
    x, grad = inputs(shape, dtype, device, full, param_dtype)
    out, grads = run(selective_scan, x, grad, delta_softplus=softplus)
    base_out, base_grads = run(selective_scan_ref, x, grad, delta_softplus=softplus)
    ref_out, ref_grads = run(
        selective_scan_ref, {k: v.double().cpu() for k, v in x.items()}, grad.double().cpu(), delta_softplus=softplus
    )
    assert out.dtype == dtype and out.shape == x["u"].shape and out.device == x["u"].device
    within_torch_error(f"out {shape} {dtype}", out, base_out, ref_out)
    assert set(grads) == set(x)
    for name in grads:
        assert grads[name].dtype == x[name].dtype and torch.isfinite(grads[name]).all(), name
        within_torch_error(f"d{name} {shape} {dtype}", grads[name], base_grads[name], ref_grads[name])


@pytest.mark.parametrize("shape", [(2, 3, 100, 4), (1, 7, 7, 1)], ids=str)
def test_document_resets_match_reference(shape, device, within_torch_error):
    """Packed documents: the state is zeroed at document starts (in and across chunks), output and gradients."""
    x, grad = inputs(shape, F32, device)
    reset = torch.zeros(shape[0], shape[2], dtype=torch.bool)
    reset[0, [1, shape[2] // 2, shape[2] - 1]] = True  # starts inside chunks and at the last step
    if shape[2] > 64:
        reset[-1, 64] = True  # a chunk's first step (the kernel's chunks are 16..64 steps)
    out, grads = run(selective_scan, x, grad, delta_softplus=True, reset=reset.to(device))
    base_out, base_grads = run(selective_scan_ref, x, grad, delta_softplus=True, reset=reset.to(device))
    ref_x = {k: v.double().cpu() for k, v in x.items()}
    ref_out, ref_grads = run(selective_scan_ref, ref_x, grad.double().cpu(), delta_softplus=True, reset=reset)
    no_reset = run(selective_scan_ref, ref_x, grad.double().cpu(), delta_softplus=True)[0]
    assert not torch.allclose(ref_out, no_reset)  # the resets matter
    within_torch_error(f"out {shape} reset", out, base_out, ref_out)
    for name in grads:
        within_torch_error(f"d{name} {shape} reset", grads[name], base_grads[name], ref_grads[name])


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fp32_all_options_match_reference(shape, device, within_torch_error):
    check(shape, F32, device, within_torch_error)


@pytest.mark.parametrize("shape", SHAPES[:3], ids=str)
def test_fp32_bare_scan_matches_reference(shape, device, within_torch_error):
    """No D, z, delta_bias or softplus: Δ is used as given."""
    check(shape, F32, device, within_torch_error, full=False, softplus=False)


@pytest.mark.parametrize("dtype, param_dtype", [(F16, F32), (BF16, F32), (BF16, BF16)])
def test_half_precision_matches_reference(dtype, param_dtype, device, within_torch_error):
    """16-bit activations; D and delta_bias in fp32 or, as in a bf16 model, bf16 (A stays fp32 as Mamba passes it)."""
    shape = (2, 64, 1000, 16) if ON_CUDA else (1, 4, 40, 8)
    check(shape, dtype, device, within_torch_error, param_dtype=param_dtype)


def test_strided_inputs_and_no_grad(device):
    """Transposed views (the layer passes (B, L, ·) buffers as (B, ·, L)) are accepted; under no_grad the result
    equals the differentiable path."""
    x, _ = inputs((2, 5, 20, 4), F32, device)
    x["delta"] = x["delta"].transpose(1, 2).contiguous().transpose(1, 2)
    x["B"] = x["B"].transpose(1, 2).contiguous().transpose(1, 2)
    assert not x["delta"].is_contiguous()
    with torch.no_grad():
        out = selective_scan(**x, delta_softplus=True)
    leaves = {k: v.clone().requires_grad_(True) for k, v in x.items()}
    torch.testing.assert_close(out, selective_scan(**leaves, delta_softplus=True).detach(), rtol=0, atol=0)
    torch.testing.assert_close(out, selective_scan_ref(**x, delta_softplus=True), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(u=torch.zeros(1, 2, 3, dtype=F64)), "fp16, bf16 or fp32"),
        (dict(A=torch.zeros(3, 4)), r"A must be \(dim=2, state\)"),
        (dict(B=torch.zeros(1, 5, 3)), "B and C must be"),
        (dict(A=torch.zeros(2, 257), B=torch.zeros(1, 257, 3), C=torch.zeros(1, 257, 3)), "state size"),
    ],
)
def test_unsupported_inputs_raise(bad, match, device):
    x = dict(
        u=torch.zeros(1, 2, 3),
        delta=torch.zeros(1, 2, 3),
        A=torch.zeros(2, 4),
        B=torch.zeros(1, 4, 3),
        C=torch.zeros(1, 4, 3),
    )
    x.update(bad)
    with pytest.raises(ValueError, match=match):
        selective_scan(**{k: v.to(device) for k, v in x.items()})


def test_mamba_layer_on_the_kernel(device):
    """The layer with impl="triton" equals the layer with impl="torch" (same weights), output and gradients."""
    layers = []
    for impl in ("torch", "triton"):
        cfg = MambaConfig(d_state=4, d_conv=3, expand=2, chunk_size=8, inner_norms=True, impl=impl)
        with torch.device("meta"):
            layer = Mamba(16, cfg, norm_eps=1e-5, init_std=0.02)
        layer.to_empty(device=device)
        torch.manual_seed(0)
        layer.init_weights()
        layers.append(layer)
    x = torch.randn(2, 37, 16, device=device)
    outs = []
    for layer in layers:
        out = layer(x)
        out.square().sum().backward()
        outs.append(out)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    for (name, p_torch), p_triton in zip(layers[0].named_parameters(), layers[1].parameters()):
        torch.testing.assert_close(p_triton.grad, p_torch.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_decoder_on_both_kernels_keeps_packed_documents_apart(device):
    """Attention and Mamba on the Triton kernels, dropless MoE: a document of a packed row gives the logits it
    gives alone (positions restart, state resets), and changing it leaves the other documents unchanged."""
    from moe_dist.config import ModelConfig
    from moe_dist.models.decoder import build_model, materialize_whole

    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, d_ff=48, mixer_pattern="AM", ffn_pattern="E")
    cfg.attention.n_heads, cfg.attention.n_kv_heads, cfg.attention.impl = 2, 1, "triton"
    cfg.mamba.impl, cfg.moe.num_experts, cfg.moe.capacity_factor = "triton", 4, None
    model = materialize_whole(build_model(cfg, device), device, seed=0)
    assert model.implementations()["attention"] == "triton" and model.implementations()["scan"] == "triton"
    lengths = [5, 9, 1]
    docs = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])[None].to(device)  # (1, 20)
    tokens = torch.randint(0, 64, docs.shape, generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        packed = model(tokens, document_ids=docs).logits[0]
        changed = tokens.clone()
        changed[docs == 1] = (changed[docs == 1] + 1) % 64
        other = model(changed, document_ids=docs).logits[0]
        for d in range(len(lengths)):
            alone = model(tokens[docs == d][None]).logits[0]
            assert (packed[docs[0] == d] - alone).abs().max() < 1e-5, d
    assert (other[docs[0] != 1] - packed[docs[0] != 1]).abs().max() < 1e-6
    assert (other[docs[0] == 1] - packed[docs[0] == 1]).abs().max() > 1e-3


def _scan_with_state(x, h0, steps: slice, reset=None, **kw):
    """The kernel on steps `steps` of the inputs x from initial state h0: (y, final state)."""
    part = {k: v[..., steps] if v.dim() == 3 else v for k, v in x.items()}
    rs = None if reset is None else reset[:, steps]
    return selective_scan(**part, reset=rs, initial_state=h0, return_final_state=True, delta_softplus=True, **kw)


@pytest.mark.parametrize("with_init", [False, True])
@pytest.mark.parametrize("shape, split, resets", [((2, 3, 70, 4), 37, [0, 37, 50]), ((1, 7, 7, 1), 3, [])], ids=str)
def test_split_run_composes_through_the_state(shape, split, resets, with_init, device):
    """Context parallelism's contract: the whole run (from an initial state or zeros) equals the run split in two
    with the first half's final state as the second's initial state: outputs, final state, and the gradient of every
    input and of the initial state (loss on the outputs and on the final state). Resets include the first step and
    the split step (a document starting exactly at a piece edge)."""
    x, grad = inputs(shape, F32, device)
    g = torch.Generator().manual_seed(7)
    h0 = torch.randn(shape[0], shape[1], shape[3], generator=g).to(device) if with_init else None
    grad_final = torch.randn(shape[0], shape[1], shape[3], generator=g).to(device)
    reset = torch.zeros(shape[0], shape[2], dtype=torch.bool, device=device)
    reset[-1, resets] = True
    results = []
    for pieces in ([slice(None)], [slice(0, split), slice(split, None)]):
        leaves = {k: v.detach().clone().requires_grad_(True) for k, v in x.items()}
        init = None if h0 is None else h0.clone().requires_grad_(True)
        state, ys = init, []
        for steps in pieces:
            y, state = _scan_with_state(leaves, state, steps, reset)
            ys.append(y)
        y = torch.cat(ys, dim=2)
        assert state.dtype == F32 and state.shape == grad_final.shape
        ((y * grad).sum() + (state * grad_final).sum()).backward()
        grads = {k: v.grad for k, v in leaves.items()} | ({} if init is None else {"initial_state": init.grad})
        results.append((y.detach(), state.detach(), grads))
    (y_whole, f_whole, g_whole), (y_split, f_split, g_split) = results
    torch.testing.assert_close(y_split, y_whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(f_split, f_whole, rtol=1e-5, atol=1e-5)
    assert set(g_split) == set(g_whole) == set(x) | ({"initial_state"} if with_init else set())
    for name in g_whole:
        scale = g_whole[name].abs().max().item()
        torch.testing.assert_close(g_split[name], g_whole[name], rtol=1e-4, atol=1e-5 * scale, msg=name)


def test_final_state_and_zero_initial_state_against_reference(device):
    """The final state h_{L-1} equals the reference's, read out through C (a C that is one-hot in state n at the
    last step makes the reference's last output h_{L-1}[:, :, n]); a zero initial state changes nothing."""
    shape = (2, 3, 45, 4)  # a ragged last chunk: the final state must not decay through the padding steps
    x, grad = inputs(shape, F32, device)
    zeros = torch.zeros(shape[0], shape[1], shape[3], device=device)
    y, final = selective_scan(**x, delta_softplus=True, initial_state=zeros, return_final_state=True)
    plain = {k: v.double().cpu() for k, v in x.items() if k not in ("z", "D")}
    for n in range(shape[3]):
        C = torch.zeros_like(plain["C"])
        C[:, n, -1] = 1.0
        h_n = selective_scan_ref(**(plain | {"C": C}), delta_softplus=True)[:, :, -1]
        torch.testing.assert_close(final[:, :, n].double().cpu(), h_n, rtol=1e-5, atol=1e-5)
    out, grads = run(selective_scan, x, grad, delta_softplus=True)
    out0, grads0 = run(lambda **k: selective_scan(**k, delta_softplus=True, initial_state=zeros), x, grad)
    torch.testing.assert_close(y, out, rtol=0, atol=0)
    torch.testing.assert_close(out0, out, rtol=0, atol=0)
    for name in grads:
        torch.testing.assert_close(grads0[name], grads[name], rtol=0, atol=0)


def test_initial_state_against_reference(device):
    """An initial state p qᵀ (per batch) equals the reference run with one step before the sequence that injects
    it (Δ = 1, u = p, B = q, no softplus): outputs, every input's gradient, and the initial state's gradient as the
    reference gives it through that step (d p = dh₋₁ q, d q = Σ_d dh₋₁ p)."""
    batch, dim, seqlen, state = 2, 3, 40, 4
    x, grad = inputs((batch, dim, seqlen, state), F32, device, full=False)
    g = torch.Generator().manual_seed(3)
    p, q = torch.randn(batch, dim, generator=g).to(device), torch.randn(batch, state, generator=g).to(device)
    h0 = (p[:, :, None] * q[:, None, :]).requires_grad_(True)
    out, grads = run(lambda **k: selective_scan(**k, initial_state=h0), x, grad)
    ext = {k: v.double().cpu() for k, v in x.items()}
    ext["u"] = torch.cat([p.double().cpu()[:, :, None], ext["u"]], dim=2)
    ext["delta"] = torch.cat([torch.ones(batch, dim, 1, dtype=F64), ext["delta"]], dim=2)
    ext["B"] = torch.cat([q.double().cpu()[:, :, None], ext["B"]], dim=2)
    ext["C"] = torch.cat([torch.zeros(batch, state, 1, dtype=F64), ext["C"]], dim=2)
    ext_grad = torch.cat([torch.zeros(batch, dim, 1, dtype=F64), grad.double().cpu()], dim=2)
    ref_out, ref_grads = run(selective_scan_ref, ext, ext_grad)
    torch.testing.assert_close(out.double().cpu(), ref_out[:, :, 1:], rtol=1e-5, atol=1e-5)
    for name in ("u", "delta", "B", "C"):
        torch.testing.assert_close(grads[name].double().cpu(), ref_grads[name][:, :, 1:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(grads["A"].double().cpu(), ref_grads["A"], rtol=1e-4, atol=1e-4)  # step −1: h = 0
    d_h0 = h0.grad.double().cpu()
    dp, dq = torch.einsum("bdn,bn->bd", d_h0, q.double().cpu()), torch.einsum("bdn,bd->bn", d_h0, p.double().cpu())
    torch.testing.assert_close(dp, ref_grads["u"][:, :, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dq, ref_grads["B"][:, :, 0], rtol=1e-5, atol=1e-5)


def test_initial_state_shape_is_checked(device):
    x, _ = inputs((1, 2, 5, 3), F32, device, full=False)
    with pytest.raises(ValueError, match=r"initial_state must be \(batch, dim, state\) \(1, 2, 3\)"):
        selective_scan(**x, initial_state=torch.zeros(1, 3, 2, device=device))
