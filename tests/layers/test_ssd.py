"""Chunked SSD scan (Mamba-2) == step-by-step reference: outputs, final states and every gradient; the oracle."""

import pytest
import torch
from moe_dist.kernels.reference import ssd_scan_ref

from moe_dist.layers.ssd import ssd_scan

BATCH, HEADS, HEAD_DIM, GROUPS, STATE = 2, 4, 3, 2, 5


def make_inputs(seqlen, dtype=torch.float64, seed=0, groups=GROUPS):
    """Random inputs in realistic ranges: A < 0, dt > 0 (after the caller's softplus)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype)

    return {
        "x": rand(BATCH, seqlen, HEADS, HEAD_DIM),
        "dt": torch.rand(BATCH, seqlen, HEADS, generator=g, dtype=dtype) * 0.5 + 0.01,
        "A": -torch.exp(rand(HEADS)),
        "B": rand(BATCH, seqlen, groups, STATE),
        "C": rand(BATCH, seqlen, groups, STATE),
        "D": rand(HEADS),
        "initial_state": rand(BATCH, HEADS, HEAD_DIM, STATE),
    }


def document_starts(seqlen, seed=0):
    """(B, L) bool: a few document starts per row, one at t = 0 in the first row (drops the initial state)."""
    g = torch.Generator().manual_seed(seed + 100)
    reset = torch.rand(BATCH, seqlen, generator=g) < 0.1
    reset[0, 0] = True
    return reset


def _grads(fn, inputs, reset, weights):
    leaves = {k: v.detach().clone().requires_grad_() for k, v in inputs.items() if v is not None}
    y, state = fn(**leaves, reset=reset)
    loss = (y * weights[0]).sum() + (state * weights[1]).sum()
    return y, state, dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))


# Lengths below, at and past chunk boundaries (chunk 16: one partial chunk, exact multiples, many chunks and a tail;
# chunk 5: many chunks and a short last one), with and without document starts, initial state and D.
@pytest.mark.parametrize("seqlen, chunk_size", [(1, 16), (7, 16), (16, 16), (17, 16), (100, 16), (23, 5)])
@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("with_state, with_d", [(False, False), (True, True)])
def test_chunked_matches_sequential(seqlen, chunk_size, documents, with_state, with_d):
    inputs = make_inputs(seqlen)
    if not with_state:
        inputs["initial_state"] = None
    if not with_d:
        inputs["D"] = None
    reset = document_starts(seqlen) if documents else None
    g = torch.Generator().manual_seed(7)
    weights = (
        torch.randn(BATCH, seqlen, HEADS, HEAD_DIM, generator=g, dtype=torch.float64),
        torch.randn(BATCH, HEADS, HEAD_DIM, STATE, generator=g, dtype=torch.float64),
    )
    y_ref, s_ref, g_ref = _grads(ssd_scan_ref, inputs, reset, weights)
    y, s, grads = _grads(lambda **kw: ssd_scan(**kw, chunk_size=chunk_size), inputs, reset, weights)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s, s_ref, rtol=1e-10, atol=1e-10)
    assert grads.keys() == g_ref.keys()
    for name in grads:
        torch.testing.assert_close(
            grads[name], g_ref[name], rtol=1e-10, atol=1e-10, msg=lambda m, name=name: f"grad of {name}: {m}"
        )


@pytest.mark.parametrize("groups", [1, HEADS])
def test_group_counts(groups):
    inputs = make_inputs(19, groups=groups, seed=1)
    y_ref, s_ref = ssd_scan_ref(**inputs)
    y, s = ssd_scan(**inputs, chunk_size=8)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s, s_ref, rtol=1e-10, atol=1e-10)


def test_chunk_size_does_not_change_result():
    inputs = make_inputs(37, seed=2)
    reset = document_starts(37, seed=2)
    y0, s0 = ssd_scan(**inputs, reset=reset, chunk_size=64)
    for chunk_size in (1, 2, 8, 32):
        y, s = ssd_scan(**inputs, reset=reset, chunk_size=chunk_size)
        torch.testing.assert_close(y, y0, rtol=1e-11, atol=1e-11)
        torch.testing.assert_close(s, s0, rtol=1e-11, atol=1e-11)


def test_split_sequence_continues_from_the_final_state():
    """Generation and context parallelism: scanning [0, t) then [t, L) from its final state equals one scan."""
    inputs = make_inputs(30, seed=3)
    reset = document_starts(30, seed=3)
    y, s = ssd_scan(**inputs, reset=reset, chunk_size=8)
    first = {k: v[:, :13] if v.dim() > 1 and k != "initial_state" else v for k, v in inputs.items()}
    rest = {k: v[:, 13:] if v.dim() > 1 and k != "initial_state" else v for k, v in inputs.items()}
    y1, s1 = ssd_scan(**first, reset=reset[:, :13], chunk_size=8)
    y2, s2 = ssd_scan(**{**rest, "initial_state": s1}, reset=reset[:, 13:], chunk_size=8)
    torch.testing.assert_close(torch.cat([y1, y2], 1), y, rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(s2, s, rtol=1e-11, atol=1e-11)


def test_empty_sequence():
    inputs = make_inputs(0)
    y, s = ssd_scan(**inputs)
    assert y.shape == (BATCH, 0, HEADS, HEAD_DIM)
    torch.testing.assert_close(s, inputs["initial_state"])


def test_reference_matches_closed_form():
    """With A = 0 nothing decays, so S_t = S_0 + Σ_{s≤t} dt_s x_s ⊗ B_s: checks the oracle itself, not just
    agreement; one group so every head reads the same B and C."""
    inputs = make_inputs(9, seed=4, groups=1)
    x, dt, B, C, S0 = inputs["x"], inputs["dt"], inputs["B"][:, :, 0], inputs["C"][:, :, 0], inputs["initial_state"]
    inputs["A"] = torch.zeros(HEADS, dtype=torch.float64)
    S = S0[:, None] + torch.cumsum((dt[..., None] * x)[..., None] * B[:, :, None, None, :], dim=1)  # (B,L,H,P,N)
    expected = torch.einsum("blhpn,bln->blhp", S, C) + inputs["D"][:, None] * x
    for scan in (ssd_scan_ref, ssd_scan):
        y, s = scan(**inputs)
        torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(s, S[:, -1], rtol=1e-12, atol=1e-12)


def test_long_chunk_with_strong_decay_is_finite_and_matches():
    """Decays that underflow to 0 inside a chunk must not produce inf/nan, forward or backward."""
    inputs = make_inputs(100, seed=5)
    inputs["A"] = inputs["A"] * 50.0
    inputs["dt"] = inputs["dt"] * 20.0
    weights = (
        torch.ones(BATCH, 100, HEADS, HEAD_DIM, dtype=torch.float64),
        torch.ones(BATCH, HEADS, HEAD_DIM, STATE, dtype=torch.float64),
    )
    y_ref, _, g_ref = _grads(ssd_scan_ref, inputs, None, weights)
    y, _, grads = _grads(lambda **kw: ssd_scan(**kw, chunk_size=64), inputs, None, weights)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    for name in grads:
        assert torch.isfinite(grads[name]).all(), name
        torch.testing.assert_close(grads[name], g_ref[name], rtol=1e-9, atol=1e-10)


def test_bf16_within_twice_torch_own_error():
    """bf16 activations: the chunked scan's error against exact math on the same rounded inputs is at most twice
    that of the step-by-step reference run in bf16 by PyTorch (fp32 inside), plus a small atol."""
    inputs64 = make_inputs(40, seed=6)
    inputs = {k: v.to(torch.bfloat16) for k, v in inputs64.items()}
    y, s = ssd_scan(**inputs, chunk_size=16)
    assert y.dtype == torch.bfloat16 and s.dtype == torch.float32
    exact, s_exact = ssd_scan_ref(**{k: v.double() for k, v in inputs.items()})
    y_torch, _ = ssd_scan_ref(**inputs)
    torch_err = (y_torch.double() - exact).abs().max()
    assert (y.double() - exact).abs().max() <= 2 * torch_err + 1e-3
    torch.testing.assert_close(s.double(), s_exact, rtol=1e-5, atol=1e-5)


def test_fp32_gradients_match_fp64_reference():
    """The training dtype: fp32 math (segment sums, chunk einsums) against exact math on the same inputs."""
    inputs32 = {k: v.float() for k, v in make_inputs(70, seed=7).items()}
    inputs64 = {k: v.double() for k, v in inputs32.items()}
    reset = document_starts(70, seed=7)
    g = torch.Generator().manual_seed(8)
    weights = (torch.randn(BATCH, 70, HEADS, HEAD_DIM, generator=g), torch.randn(BATCH, HEADS, HEAD_DIM, STATE))
    y, s, grads = _grads(lambda **kw: ssd_scan(**kw, chunk_size=16), inputs32, reset, weights)
    y_ref, s_ref, g_ref = _grads(ssd_scan_ref, inputs64, reset, tuple(w.double() for w in weights))
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s.double(), s_ref, rtol=1e-5, atol=1e-5)
    for name in grads:
        assert grads[name].dtype == torch.float32
        scale = g_ref[name].abs().max()
        torch.testing.assert_close(
            grads[name].double(),
            g_ref[name],
            rtol=1e-4,
            atol=1e-5 * scale,
            msg=lambda m, name=name: f"grad {name}: {m}",
        )
