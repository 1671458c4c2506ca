"""Packed documents: with `document_ids`, no document sees another, through attention (mask, RoPE positions),
Mamba, Mamba-2 and Gated DeltaNet (conv, recurrent state) and dropless MoE; prefix-LM masks against an explicit
masked softmax."""

import math

import pytest
import torch
from moe_dist.kernels.reference import selective_scan_ref

from moe_dist.config import ModelConfig
from moe_dist.layers.scan import selective_scan
from moe_dist.layers.sdpa import sdpa
from moe_dist.models.decoder import build_model, materialize_whole

LENGTHS = [[7, 12, 1, 12], [20, 12]]  # documents per row (row 1 ends mid-document, as a window does)


def _document_ids(lengths: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.cat([torch.full((n,), d) for d, n in enumerate(row)]) for row in lengths])


def _model(**over) -> torch.nn.Module:
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=4, d_ff=48, mixer_pattern="AM", ffn_pattern="DE")
    cfg.attention.n_heads, cfg.attention.n_kv_heads = 4, 2
    cfg.moe.num_experts, cfg.moe.capacity_factor = 4, None  # dropless: routing is per token
    for key, value in over.items():
        setattr(cfg, key, value)
    return materialize_whole(build_model(cfg), "cpu", seed=0)


# The pattern model (attention, Mamba, dense and MoE), and one of every kind of the layer list, the new mixers with
# small heads so that several heads and chunks are exercised.
RECURRENT = ["mamba2+mlp", "gdn+moe", "attention", "gdn", "mamba2+moe"]


@pytest.fixture(scope="module", params=["patterns", "mamba2+gdn"])
def model(request):
    if request.param == "patterns":
        return _model()
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=len(RECURRENT), d_ff=48, layers=RECURRENT)
    cfg.attention.n_heads, cfg.attention.n_kv_heads = 4, 2
    cfg.moe.num_experts, cfg.moe.capacity_factor = 4, None
    cfg.mamba2.head_dim, cfg.mamba2.d_state, cfg.mamba2.n_groups, cfg.mamba2.chunk_size = 16, 8, 2, 8
    cfg.gdn.n_k_heads, cfg.gdn.n_v_heads, cfg.gdn.head_k_dim, cfg.gdn.head_v_dim, cfg.gdn.chunk_size = 2, 4, 8, 8, 8
    return materialize_whole(build_model(cfg), "cpu", seed=0)


def test_changing_one_document_leaves_the_others_unchanged(model):
    torch.manual_seed(0)
    docs = _document_ids(LENGTHS)  # (2, 32)
    tokens = torch.randint(0, 64, docs.shape)
    with torch.no_grad():
        base = model(tokens, document_ids=docs).logits
        changed = tokens.clone()
        changed[0][docs[0] == 1] = torch.randint(0, 64, ((docs[0] == 1).sum(),))
        out = model(changed, document_ids=docs).logits
        plain = model(tokens).logits
    other = docs[0] != 1
    assert (out[0][~other] - base[0][~other]).abs().max() > 1e-3  # the changed document did change
    # Every other document of the row, and the other row, is unchanged (fp32; not bitwise: the MoE's grouped
    # expert GEMMs see other rows of tokens).
    assert (out[0][other] - base[0][other]).abs().max() < 1e-6
    assert (out[1] - base[1]).abs().max() < 1e-6
    # Without document ids the first document's logits are unchanged (causal), the later ones are not.
    assert torch.allclose(plain[0][docs[0] == 0], base[0][docs[0] == 0], atol=1e-6)
    assert not torch.allclose(plain[0][docs[0] == 2], base[0][docs[0] == 2], atol=1e-6)


def test_a_packed_document_equals_the_document_alone(model):
    """Positions restart and the Mamba state resets: each document of a packed row gives the logits it gives
    as its own sequence, in fp32 within 1e-6."""
    m = model
    torch.manual_seed(1)
    docs = _document_ids(LENGTHS)
    tokens = torch.randint(0, 64, docs.shape)
    with torch.no_grad():
        packed = m(tokens, document_ids=docs).logits
        worst = 0.0
        for r in range(2):
            for d in docs[r].unique():
                sel = docs[r] == d
                alone = m(tokens[r][sel][None]).logits[0]
                worst = max(worst, (packed[r][sel] - alone).abs().max().item())
    assert worst < 1e-6, worst


def test_gradients_stay_inside_their_document(model):
    docs = _document_ids(LENGTHS)
    tokens = torch.randint(0, 64, docs.shape)
    x = model.embed(tokens).detach().requires_grad_()
    h = x
    for block in model.blocks:
        h, _ = block(h, None, document_ids=docs, prefix=None)
    h[0][docs[0] == 2].sum().backward()
    grad = x.grad[0].abs().sum(-1)  # (S,)
    assert grad[docs[0] == 2].min() > 0 and grad[docs[0] != 2].max() == 0


def test_scan_reset_matches_reference_and_separate_sequences():
    torch.manual_seed(0)
    Bt, Di, N, L = 2, 6, 4, 37
    u, delta, z = torch.randn(Bt, Di, L), torch.randn(Bt, Di, L), torch.randn(Bt, Di, L)
    A = -torch.rand(Di, N) - 0.5
    Bm, Cm = torch.randn(Bt, N, L), torch.randn(Bt, N, L)
    D, bias = torch.randn(Di), torch.randn(Di)
    reset = torch.zeros(Bt, L, dtype=torch.bool)
    reset[0, [5, 16, 17]] = True
    reset[1, 30] = True
    args = [t.double().requires_grad_() for t in (u, delta, A, Bm, Cm, D, z, bias)]
    ours = selective_scan(*args[:6], z=args[6], delta_bias=args[7], delta_softplus=True, chunk_size=8, reset=reset)
    ref = selective_scan_ref(*args[:6], z=args[6], delta_bias=args[7], delta_softplus=True, reset=reset)
    assert torch.allclose(ours, ref, atol=1e-10)
    g = torch.randn_like(ours)
    grads = torch.autograd.grad(ours, args, g)
    ref_grads = torch.autograd.grad(ref, args, g)
    for a, b in zip(grads, ref_grads):
        assert torch.allclose(a, b, atol=1e-9)
    # The segment after a reset equals a scan of that segment alone.
    seg = slice(17, L)
    alone = selective_scan_ref(
        *(t[:1, ..., seg] if t.dim() == 3 else t for t in args[:6]), z=args[6][:1, :, seg], delta_bias=args[7],
        delta_softplus=True,
    )  # fmt: skip
    assert torch.allclose(ref[:1, :, seg], alone, atol=1e-12)


def _masked_softmax_reference(q, k, v, allowed):
    """Explicit attention: scores, -inf where not allowed, softmax, weighted values (grouped heads repeated)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return scores.masked_fill(~allowed[:, None], float("-inf")).softmax(-1) @ v


def test_sdpa_document_and_prefix_masks_match_explicit_reference():
    torch.manual_seed(0)
    docs = _document_ids(LENGTHS)
    S = docs.shape[1]
    prefix = torch.zeros_like(docs, dtype=torch.bool)
    prefix[0, :3] = prefix[0, 7:12] = prefix[1, :20] = True  # prompts: the first tokens of some documents
    q, k, v = torch.randn(2, 4, S, 8).double(), torch.randn(2, 2, S, 8).double(), torch.randn(2, 2, S, 8).double()
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    same = docs[:, :, None] == docs[:, None, :]
    for pre in (None, prefix):
        allowed = same & ((j <= i) | (pre[:, :, None] & pre[:, None, :] if pre is not None else False))
        out = sdpa(q, k, v, document_ids=docs, prefix=pre)
        assert torch.allclose(out, _masked_softmax_reference(q, k, v, allowed), atol=1e-12)
    # A prompt token sees the later prompt tokens of its document, never a completion token or another document.
    assert allowed[0, 0, 2] and not allowed[0, 0, 3] and not allowed[0, 7, 3] and allowed[0, 8, 11]


def test_prefix_lm_is_bidirectional_in_attention_only():
    """With a prefix, an early prompt token's output depends on later prompt tokens through attention layers,
    never through Mamba layers (they stay causal), and never on the completion."""
    docs = torch.zeros(1, 12, dtype=torch.long)
    prefix = torch.zeros(1, 12, dtype=torch.bool)
    prefix[0, :6] = True
    tokens = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    later_prompt, completion = tokens.clone(), tokens.clone()
    later_prompt[0, 4] = (later_prompt[0, 4] + 1) % 64
    completion[0, 8] = (completion[0, 8] + 1) % 64
    for pattern, bidirectional in (("A", True), ("M", False)):
        m = _model(mixer_pattern=pattern)
        with torch.no_grad():
            base, moved, tail = (
                m(t, document_ids=docs, prefix=prefix).logits[0] for t in (tokens, later_prompt, completion)
            )
        assert ((moved[:4] - base[:4]).abs().max() > 1e-4) == bidirectional, pattern
        assert (tail[:8] - base[:8]).abs().max() < 1e-6, pattern


def test_prefix_mask_needs_document_masking():
    from moe_dist.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"^model\.attention\.mask: 'prefix' needs data\.document_masking=true"):
        load_config(None, ["model.attention.mask=prefix"])
    assert (
        load_config(None, ["model.attention.mask=prefix", "data.document_masking=true"]).model.attention.mask
        == "prefix"
    )
