"""Chunked parallel selective scan == sequential reference, outputs and every gradient; the in-place scan."""

import pytest
import torch
import torch.nn.functional as F
from moe_dist.kernels.reference import selective_scan_ref

from moe_dist.layers.scan import _scan_steps, initial_state_outputs, selective_scan

BATCH, DIM, STATE = 2, 3, 4
INPUT_NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")


def make_inputs(seqlen, dtype=torch.float64, seed=0):
    """Random inputs in realistic ranges: A < 0, Δ > 0 (before the optional softplus it may be any sign)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype)

    return {
        "u": rand(BATCH, DIM, seqlen),
        "delta": torch.rand(BATCH, DIM, seqlen, generator=g, dtype=dtype) * 0.5,
        "A": -torch.exp(rand(DIM, STATE)),
        "B": rand(BATCH, STATE, seqlen),
        "C": rand(BATCH, STATE, seqlen),
        "D": rand(DIM),
        "z": rand(BATCH, DIM, seqlen),
        "delta_bias": rand(DIM) * 0.5,
    }


# (use D, use z, use delta_bias, delta_softplus)
OPTIONS = [
    (False, False, False, False),
    (True, True, True, True),
    (True, False, False, True),
    (False, True, True, False),
]


# Lengths below, at and just past chunk boundaries (chunk 16: one partial chunk, exact multiples, one spare step;
# chunk 5: many chunks and a short last one).
@pytest.mark.parametrize("seqlen, chunk_size", [(1, 16), (7, 16), (100, 16), (16, 16), (17, 16), (32, 16), (23, 5)])
@pytest.mark.parametrize("use_d, use_z, use_bias, softplus", OPTIONS)
def test_chunked_matches_sequential(seqlen, chunk_size, use_d, use_z, use_bias, softplus):
    inputs = make_inputs(seqlen)
    if not use_d:
        inputs["D"] = None
    if not use_z:
        inputs["z"] = None
    if not use_bias:
        inputs["delta_bias"] = None
    leaves = {k: v.requires_grad_() for k, v in inputs.items() if v is not None}
    grad_out = torch.randn(BATCH, DIM, seqlen, dtype=torch.float64)

    y_ref = selective_scan_ref(**inputs, delta_softplus=softplus)
    y = selective_scan(**inputs, delta_softplus=softplus, chunk_size=chunk_size)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)

    grads_ref = torch.autograd.grad(y_ref, list(leaves.values()), grad_out)
    grads = torch.autograd.grad(y, list(leaves.values()), grad_out)
    for name, g, g_ref in zip(leaves, grads, grads_ref):
        if name != "A" or seqlen > 1:  # A only acts once there is a previous state to decay
            assert g_ref.abs().sum() > 0, name  # so a zero gradient cannot pass by matching a zero
        torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-10, msg=lambda m, name=name: f"grad of {name}: {m}")


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 64, 128])
def test_chunk_size_does_not_change_result(chunk_size):
    inputs = make_inputs(100, seed=1)
    leaves = [v.requires_grad_() for v in inputs.values()]
    y_ref = selective_scan_ref(**inputs, delta_softplus=True)
    y = selective_scan(**inputs, delta_softplus=True, chunk_size=chunk_size)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    grad_out = torch.randn_like(y)
    grads_ref = torch.autograd.grad(y_ref, leaves, grad_out)
    for name, g, g_ref in zip(INPUT_NAMES, torch.autograd.grad(y, leaves, grad_out), grads_ref):
        torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-10, msg=lambda m, name=name: f"grad of {name}: {m}")


def test_time_major_views_as_mamba_passes_them():
    """Mamba hands over Δ, B, C and z as transposed views of (B, L, ·) tensors; results must not depend on strides."""
    inputs = make_inputs(37, seed=5)
    views = {
        k: v.transpose(1, 2).contiguous().transpose(1, 2) if k in ("delta", "B", "C", "z") else v.clone()
        for k, v in inputs.items()
    }
    results = []
    for args in (inputs, views):
        leaves = [v.requires_grad_() for v in args.values()]
        y = selective_scan(**args, delta_softplus=True, chunk_size=8)
        results.append((y, *torch.autograd.grad(y, leaves, torch.ones_like(y))))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)  # only summation order may differ


def test_empty_sequence():
    inputs = {k: v.requires_grad_() for k, v in make_inputs(0).items()}
    y = selective_scan(**inputs, delta_softplus=True)
    assert y.shape == (BATCH, DIM, 0)
    y.sum().backward()
    assert inputs["A"].grad.abs().sum() == 0


def run_scan(coef, x, reverse, coef_work=None):
    for step in _scan_steps(coef, x, reverse, coef_work):
        step()


def loop_scan(coef, x, reverse):
    """x_t + coef_t x_{t∓1}, one step at a time along dim 1: the oracle for the in-place parallel scan."""
    out = x.clone()
    steps = range(x.shape[1] - 2, -1, -1) if reverse else range(1, x.shape[1])
    for t in steps:
        out[:, t] += coef[:, t] * out[:, t + 1 if reverse else t - 1]
    return out


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("use_work", [False, True])
@pytest.mark.parametrize("length", [1, 2, 3, 4, 5, 7, 8, 13, 16, 33])
def test_in_place_scan_matches_loop(length, reverse, use_work):
    g = torch.Generator().manual_seed(length)
    coef = torch.rand(2, length, 3, 4, generator=g, dtype=torch.float64)
    x = torch.randn(2, length, 3, 4, generator=g, dtype=torch.float64)
    expected = loop_scan(coef, x, reverse)
    coef_before = coef.clone()
    work = torch.full((2, length // 2, 3, 4), float("nan"), dtype=torch.float64) if use_work else None
    run_scan(coef, x, reverse, coef_work=work)
    torch.testing.assert_close(x, expected, rtol=1e-12, atol=1e-12)
    if use_work:  # the pair decays went to the work buffer, so the caller can use coef again
        assert torch.equal(coef, coef_before)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("use_work", [False, True])
@pytest.mark.parametrize("length", [8, 11])
def test_in_place_scan_ignores_the_first_coefficient(length, reverse, use_work):
    """The first element in scan order has no predecessor: its coefficient (a stale value in the backward's
    spare slot) must not reach any result, even as NaN."""
    g = torch.Generator().manual_seed(0)
    coef = torch.rand(1, length, 2, 2, generator=g, dtype=torch.float64)
    x = torch.randn(1, length, 2, 2, generator=g, dtype=torch.float64)
    expected = loop_scan(coef, x, reverse)
    coef[:, -1 if reverse else 0] = float("nan")
    run_scan(coef, x, reverse, torch.empty(1, length // 2, 2, 2, dtype=torch.float64) if use_work else None)
    torch.testing.assert_close(x, expected, rtol=1e-12, atol=1e-12)


def test_reference_matches_closed_form():
    """With A = 0 nothing decays, so h_t = Σ_{s≤t} Δ_s B_s u_s: checks the oracle itself, not just agreement."""
    inputs = make_inputs(9, seed=2)
    u, delta, B, C = inputs["u"], inputs["delta"], inputs["B"], inputs["C"]
    A = torch.zeros(DIM, STATE, dtype=torch.float64)
    h = torch.cumsum((delta * u)[:, :, :, None] * B.transpose(1, 2)[:, None], dim=2)  # (B, D, L, N)
    expected = torch.einsum("bdln,bnl->bdl", h, C) + inputs["D"][:, None] * u
    expected = expected * F.silu(inputs["z"])
    for scan in (selective_scan_ref, selective_scan):
        y = scan(u, delta, A, B, C, D=inputs["D"], z=inputs["z"])
        torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)


def test_long_sequence_with_strong_decay_is_finite_and_matches():
    """Decays that underflow to 0 inside a chunk must not produce inf/nan (no division by cumulative decay)."""
    inputs = make_inputs(100, seed=3)
    inputs["A"] = inputs["A"] * 50.0
    inputs["delta"] = inputs["delta"] * 20.0
    leaves = [v.requires_grad_() for v in inputs.values()]
    y = selective_scan(**inputs, chunk_size=64)
    assert torch.isfinite(y).all()
    y_ref = selective_scan_ref(**inputs)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    grads = torch.autograd.grad(y, leaves, torch.ones_like(y))
    for name, g, g_ref in zip(INPUT_NAMES, grads, torch.autograd.grad(y_ref, leaves, torch.ones_like(y))):
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-10, msg=lambda m, name=name: f"grad of {name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_inputs_are_computed_in_fp32(dtype):
    inputs64 = make_inputs(40, seed=4)
    inputs = {k: v.to(dtype) for k, v in inputs64.items()}
    y = selective_scan(**inputs, delta_softplus=True, chunk_size=16)
    assert y.dtype == dtype
    # Same rounded inputs, evaluated exactly: only fp32 accumulation and the final cast may differ.
    exact = selective_scan_ref(**{k: v.double() for k, v in inputs.items()}, delta_softplus=True).to(dtype)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-2}
    torch.testing.assert_close(y, exact, **tol)
    torch.testing.assert_close(selective_scan_ref(**inputs, delta_softplus=True), exact, **tol)


def test_fp32_gradients_match_fp64_reference():
    """The training dtype: fp32 math (exp2-based decays, chunked reductions) against exact math on the same inputs."""
    inputs32 = {k: v.float() for k, v in make_inputs(70, seed=6).items()}
    inputs64 = {k: v.double() for k, v in inputs32.items()}
    grads = []
    for scan, args in ((selective_scan, inputs32), (selective_scan_ref, inputs64)):
        leaves = [v.requires_grad_() for v in args.values()]
        y = scan(**args, delta_softplus=True)
        grads.append(torch.autograd.grad(y, leaves, torch.ones_like(y)))
    for name, g, g_ref in zip(INPUT_NAMES, *grads):
        assert g.dtype == torch.float32
        scale = g_ref.abs().max()
        torch.testing.assert_close(
            g.double(), g_ref, rtol=1e-4, atol=1e-5 * scale, msg=lambda m, name=name: f"grad of {name}: {m}"
        )


@pytest.mark.parametrize(
    "seqlen, chunk_size, with_reset", [(1, 16, False), (23, 5, False), (40, 16, False), (23, 5, True), (40, 16, True)]
)
def test_initial_and_final_state_match_reference(seqlen, chunk_size, with_reset):
    """initial_state / return_final_state: outputs, final state and every gradient (the initial state's included,
    and gradients through the final state) equal the sequential oracle's; a reset at t = 0 drops the initial state."""
    inputs = make_inputs(seqlen, seed=7)
    g = torch.Generator().manual_seed(8)
    inputs["initial_state"] = torch.randn(BATCH, DIM, STATE, generator=g, dtype=torch.float64)
    if with_reset:
        reset = torch.rand(BATCH, seqlen, generator=g) < 0.2
        reset[:, 0] = torch.tensor([True, False])  # batch row 0 drops its initial state, row 1 keeps it
        inputs["reset"] = reset
    leaves = {k: v.requires_grad_() for k, v in inputs.items() if k != "reset"}
    grad_y = torch.randn(BATCH, DIM, seqlen, generator=g, dtype=torch.float64)
    grad_h = torch.randn(BATCH, DIM, STATE, generator=g, dtype=torch.float64)
    outs = {}
    for name, scan, kw in (("ref", selective_scan_ref, {}), ("torch", selective_scan, {"chunk_size": chunk_size})):
        y, h = scan(**inputs, delta_softplus=True, return_final_state=True, **kw)
        assert h.shape == (BATCH, DIM, STATE)
        grads = torch.autograd.grad((y, h), list(leaves.values()), (grad_y, grad_h))
        outs[name] = (y, h, *grads)
    for name, got, want in zip(("y", "final", *leaves), outs["torch"], outs["ref"]):
        assert want.abs().sum() > 0, name
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10, msg=lambda m, name=name: f"{name}: {m}")
    if with_reset:
        assert outs["ref"][2 + list(leaves).index("initial_state")][0].abs().max() == 0  # reset at t = 0


def test_split_run_composes_into_whole_run():
    """A run split in two, the second half started from the first half's final state, equals the whole run:
    outputs and every gradient (the final state's gradient reaching the first half through the initial state)."""
    inputs = make_inputs(37, seed=9)
    leaves = [v.requires_grad_() for v in inputs.values()]
    grad_y = torch.randn(BATCH, DIM, 37, dtype=torch.float64)
    y = selective_scan(**inputs, delta_softplus=True, chunk_size=8)
    whole = torch.autograd.grad(y, leaves, grad_y)
    cut = 15
    first = {k: (v[..., :cut] if v.dim() == 3 and k != "A" else v) for k, v in inputs.items()}
    second = {k: (v[..., cut:] if v.dim() == 3 and k != "A" else v) for k, v in inputs.items()}
    y1, h1 = selective_scan(**first, delta_softplus=True, chunk_size=8, return_final_state=True)
    y2 = selective_scan(**second, delta_softplus=True, chunk_size=8, initial_state=h1)
    torch.testing.assert_close(torch.cat([y1, y2], dim=-1), y, rtol=1e-12, atol=1e-12)
    split = torch.autograd.grad(torch.cat([y1, y2], dim=-1), leaves, grad_y)
    for name, g, g_ref in zip(INPUT_NAMES, split, whole):
        torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-11, msg=lambda m, name=name: f"grad of {name}: {m}")


@pytest.mark.parametrize("length, block", [(1, 16), (23, 5), (16, 16)])
def test_initial_state_outputs_match_closed_form(length, block):
    """initial_state_outputs (CP's correction for a piece's entering state) equals Σ_n C exp(A Σ Δ) h0 written
    directly, outputs and every gradient, and equals a scan with no input started from h0 (its definition)."""
    g = torch.Generator().manual_seed(10)
    C = torch.randn(BATCH, length, STATE, generator=g, dtype=torch.float64)
    delta = torch.rand(BATCH, length, DIM, generator=g, dtype=torch.float64)
    A = -torch.exp(torch.randn(DIM, STATE, generator=g, dtype=torch.float64))
    h0 = torch.randn(BATCH, DIM, STATE, generator=g, dtype=torch.float64)
    s = delta.cumsum(1)
    leaves = [t.requires_grad_() for t in (C, s, A, h0)]
    grad_y = torch.randn(BATCH, length, DIM, generator=g, dtype=torch.float64)
    want = torch.einsum("bln,bldn,bdn->bld", C, torch.exp(s[..., None] * A), h0)
    got = initial_state_outputs(C, s, A, h0, block=block)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for name, g_got, g_want in zip(
        ("C", "s", "A", "h0"), torch.autograd.grad(got, leaves, grad_y), torch.autograd.grad(want, leaves, grad_y)
    ):
        assert g_want.abs().sum() > 0, name
        torch.testing.assert_close(g_got, g_want, rtol=1e-10, atol=1e-12, msg=lambda m, n=name: f"grad of {n}: {m}")
    zeros = torch.zeros(BATCH, DIM, length, dtype=torch.float64)
    scanned = selective_scan_ref(
        zeros,
        delta.transpose(1, 2),
        A.detach(),
        torch.zeros(BATCH, STATE, length, dtype=torch.float64),
        C.detach().transpose(1, 2),
        initial_state=h0.detach(),
    )
    torch.testing.assert_close(got.detach().transpose(1, 2), scanned, rtol=1e-12, atol=1e-12)
