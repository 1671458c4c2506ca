"""Chunked gated delta rule == sequential reference: outputs, final state and every gradient; documents, initial
state, low precision; the reference against transformers' own recurrence (Qwen3-Next's convention)."""

import pytest
import torch
import torch.nn.functional as F
from moe_dist.kernels.reference import gated_delta_rule_ref

from moe_dist.layers.delta_rule import chunk_gated_delta_rule

BATCH, HEADS, DK, DV = 2, 3, 4, 5
NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def make_inputs(seqlen, dtype=torch.float64, seed=0, initial_state=True, decay=1.0):
    """Realistic ranges: L2-normalised k (as the layer gives it; the delta rule needs ‖k‖ ≤ 1 to stay stable),
    β ∈ (0, 1), g < 0."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    return {
        "q": rand(BATCH, seqlen, HEADS, DK),
        "k": F.normalize(rand(BATCH, seqlen, HEADS, DK), dim=-1),
        "v": rand(BATCH, seqlen, HEADS, DV),
        "g": -decay * torch.rand(BATCH, seqlen, HEADS, generator=gen, dtype=dtype),
        "beta": torch.rand(BATCH, seqlen, HEADS, generator=gen, dtype=dtype),
        "initial_state": rand(BATCH, HEADS, DK, DV) if initial_state else None,
    }


def document_starts(seqlen, starts_per_row):
    reset = torch.zeros(BATCH, seqlen, dtype=torch.bool)
    for row, starts in enumerate(starts_per_row):
        reset[row, [s for s in starts if s < seqlen]] = True
    return reset


def check_against_reference(inputs, reset=None, chunk_size=16, tol=1e-10):
    leaves = {k: v.requires_grad_() for k, v in inputs.items() if v is not None}
    o_ref, s_ref = gated_delta_rule_ref(**inputs, reset=reset)
    o, s = chunk_gated_delta_rule(**inputs, reset=reset, chunk_size=chunk_size)
    torch.testing.assert_close(o, o_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(s, s_ref, rtol=tol, atol=tol)
    gen = torch.Generator().manual_seed(7)
    d_o, d_s = torch.randn(o.shape, generator=gen, dtype=o.dtype), torch.randn(s.shape, generator=gen, dtype=s.dtype)
    grads_ref = torch.autograd.grad((o_ref, s_ref), list(leaves.values()), (d_o, d_s))
    grads = torch.autograd.grad((o, s), list(leaves.values()), (d_o, d_s))
    for name, g, g_ref in zip(leaves, grads, grads_ref):
        if name != "g" or inputs["initial_state"] is not None or inputs["g"].shape[1] > 1:  # g needs a state to decay
            assert g_ref.abs().sum() > 0, name  # so a zero gradient cannot pass by matching a zero
        torch.testing.assert_close(g, g_ref, rtol=tol, atol=tol, msg=lambda m, name=name: f"grad of {name}: {m}")
    return (o - o_ref).abs().max().item()


# Lengths below, at and past chunk boundaries (chunk 16: one partial chunk, exact multiples, one spare step;
# chunk 5: many chunks and a short last one).
@pytest.mark.parametrize("seqlen, chunk_size", [(1, 16), (7, 16), (16, 16), (17, 16), (100, 16), (23, 5)])
@pytest.mark.parametrize("initial_state", [False, True])
def test_chunked_matches_sequential(seqlen, chunk_size, initial_state):
    check_against_reference(make_inputs(seqlen, initial_state=initial_state), chunk_size=chunk_size)


@pytest.mark.parametrize(
    "seqlen, starts",
    [
        (37, [[0, 5, 6], [16, 20, 36]]),  # mid-chunk, adjacent, on a chunk boundary, at the last position
        (40, [[1, 2, 3, 4], [8]]),  # several starts in one chunk
    ],
)
@pytest.mark.parametrize("chunk_size", [4, 16])
def test_documents_within_and_across_chunks(seqlen, starts, chunk_size):
    check_against_reference(make_inputs(seqlen, seed=1), document_starts(seqlen, starts), chunk_size)


def test_documents_are_independent():
    """A document's outputs do not depend on what precedes its start, nor on the initial state."""
    inputs = make_inputs(30, seed=2)
    reset = document_starts(30, [[11], [11]])
    o, _ = chunk_gated_delta_rule(**inputs, reset=reset, chunk_size=8)
    alone = {k: (v if k == "initial_state" else v[:, 11:]) for k, v in inputs.items()}
    alone["initial_state"] = None
    o_alone, _ = chunk_gated_delta_rule(**alone, chunk_size=8)
    torch.testing.assert_close(o[:, 11:], o_alone, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 64, 128])
def test_chunk_size_does_not_change_result(chunk_size):
    check_against_reference(make_inputs(50, seed=3), document_starts(50, [[9], [30]]), chunk_size)


def test_strong_decay_is_finite_and_matches():
    """Cumulative decays that underflow to 0 inside a chunk must not produce inf/nan (no division by them)."""
    inputs = make_inputs(100, seed=4, decay=40.0)
    assert check_against_reference(inputs, chunk_size=64) < 1e-10


def test_empty_sequence():
    inputs = make_inputs(0)
    o, s = chunk_gated_delta_rule(**inputs)
    assert o.shape == (BATCH, 0, HEADS, DV)
    torch.testing.assert_close(s, inputs["initial_state"])


def test_reference_matches_closed_form():
    """With g = 0 and k ⊥ every earlier k the delta rule is plain linear attention: S_t = Σ_s β_s k_s v_sᵀ.
    Checks the oracle itself, not just agreement."""
    seqlen = DK  # orthonormal keys per head: the rows of an identity, permuted
    inputs = make_inputs(seqlen, seed=5, initial_state=False)
    inputs["g"] = torch.zeros_like(inputs["g"])
    inputs["k"] = torch.eye(DK, dtype=torch.float64)[torch.randperm(DK)][None, :, None].expand(BATCH, -1, HEADS, -1)
    q, k, v, beta = inputs["q"], inputs["k"], inputs["v"], inputs["beta"]
    S = torch.cumsum(k[..., :, None] * (beta[..., None] * v)[..., None, :], dim=1)  # (B, L, H, dk, dv)
    expected = torch.einsum("blhkv,blhk->blhv", S, q) * DK**-0.5
    for rule in (gated_delta_rule_ref, chunk_gated_delta_rule):
        torch.testing.assert_close(rule(**inputs)[0], expected, rtol=1e-12, atol=1e-12)


def test_reference_matches_transformers_recurrence():
    """The convention (decay before the update, q scaled by dk^-0.5, state (dk, dv)) is Qwen3-Next's."""
    qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    inputs = make_inputs(9, seed=6)
    # Without the fla package (not a dependency) transformers takes its PyTorch recurrence.
    want_o, want_s = qwen3_next.torch_recurrent_gated_delta_rule(
        *(inputs[k].float() for k in NAMES), output_final_state=True
    )
    o, s = gated_delta_rule_ref(**{k: v.float() for k, v in inputs.items()})
    torch.testing.assert_close(o, want_o, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(s, want_s, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_inputs_keep_an_fp32_state(dtype):
    inputs = {k: v.to(dtype) for k, v in make_inputs(40, seed=8).items()}
    reset = document_starts(40, [[13], []])
    o, s = chunk_gated_delta_rule(**inputs, reset=reset, chunk_size=16)
    assert o.dtype == dtype and s.dtype == torch.float32
    # Same rounded inputs evaluated exactly; the baseline is the reference's own error in this dtype (fp32 math,
    # output rounded to `dtype`): the chunked path may be at most twice as far, plus a small atol.
    exact_o, exact_s = gated_delta_rule_ref(**{k: v.double() for k, v in inputs.items()}, reset=reset)
    ref_o, ref_s = gated_delta_rule_ref(**inputs, reset=reset)
    atol = 1e-5 if dtype == torch.float32 else 1e-3
    for got, ref, exact in ((o, ref_o, exact_o), (s, ref_s, exact_s)):
        err, ref_err = (got.double() - exact).abs().max(), (ref.double() - exact).abs().max()
        assert err <= 2 * ref_err + atol, (err, ref_err)
