"""Triton flash attention against `flash_attention_ref` in fp64: output and every gradient, causal and not, grouped
heads, awkward lengths and head sizes, three dtypes; then the Attention layer running on it.

Runs under TRITON_INTERPRET=1 or MOE_DIST_KERNEL_DEVICE=cuda (see conftest.py). The PyTorch path it must stay
within twice the error of is SDPA in the same dtype, on the same device.
"""

import os

import pytest
import torch
import torch.nn.functional as F
from moe_dist.kernels.flash_attention import flash_attention
from moe_dist.kernels.reference import flash_attention_ref

from moe_dist.config import AttentionConfig
from moe_dist.layers.attention import Attention, attention_kernels
from moe_dist.layers.kernel_choice import ATTENTION_MASKS, attention_choice, attention_cp_choice
from moe_dist.layers.sdpa import sdpa as masked_sdpa
from moe_dist.layers.sequence_shard import SeqShard

ON_CUDA = os.environ.get("MOE_DIST_KERNEL_DEVICE") == "cuda"
F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64

# (batch, q_heads, kv_heads, seq, head_dim): lengths 1, 7, 100 (several tiles, ragged tail), head_dim 16..128
# including sizes that are not powers of two.
SHAPES = [(1, 2, 1, 1, 16), (2, 4, 2, 7, 32), (1, 3, 1, 100, 40), (1, 2, 2, 100, 128)]
if ON_CUDA:  # realistic sizes: many tiles in both directions, 4:1 grouping
    SHAPES += [(2, 8, 2, 1000, 64), (1, 8, 2, 2048, 128)]


def sdpa(q, k, v, causal=True, softmax_scale=None):
    return F.scaled_dot_product_attention(
        q, k, v, is_causal=causal, scale=softmax_scale, enable_gqa=q.shape[1] != k.shape[1]
    )


def inputs(shape, dtype, device, seed=0):
    batch, hq, hkv, seq, dh = shape
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, h, seq, dh, generator=g) for h in (hq, hkv, hkv))
    grad = torch.randn(batch, hq, seq, dh, generator=g)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v, grad)]


def run(fn, q, k, v, grad, **kw):
    """(out, dq, dk, dv) of fn, with fresh leaves."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v, **kw)
    out.backward(grad.to(out.dtype))
    return out.detach(), q.grad, k.grad, v.grad


def check(shape, dtype, device, within_torch_error, **kw):
    q, k, v, grad = inputs(shape, dtype, device)
    got = run(flash_attention, q, k, v, grad, **kw)
    base = run(sdpa, q, k, v, grad, **kw)
    ref = run(flash_attention_ref, *(t.double().cpu() for t in (q, k, v, grad)), **kw)
    assert got[0].dtype == dtype and got[0].shape == q.shape and got[0].device == q.device
    for name, a, b, r in zip(("out", "dq", "dk", "dv"), got, base, ref):
        assert a.dtype == dtype and torch.isfinite(a).all(), name
        within_torch_error(f"{name} {shape} {dtype}", a, b, r)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fp32_matches_reference(shape, causal, device, within_torch_error):
    check(shape, F32, device, within_torch_error, causal=causal)


@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", SHAPES[1:], ids=str)
def test_half_precision_matches_reference(shape, causal, dtype, device, within_torch_error):
    check(shape, dtype, device, within_torch_error, causal=causal)


def test_softmax_scale(device, within_torch_error):
    check((1, 2, 1, 33, 16), F32, device, within_torch_error, causal=True, softmax_scale=0.3)


def test_strided_inputs_as_the_layer_passes_them(device):
    """q/k/v as (B, S, H, Dh) buffers viewed as (B, H, S, Dh), and a non-unit last stride (copied)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 9, 4, 32, generator=g).to(device).transpose(1, 2)
    k = torch.randn(2, 9, 2, 32, generator=g).to(device).transpose(1, 2)
    v = torch.randn(2, 2, 32, 9, generator=g).to(device).transpose(2, 3)  # last stride 9
    out = flash_attention(q, k, v)
    torch.testing.assert_close(out, flash_attention_ref(q, k, v), rtol=1e-5, atol=1e-5)
    assert out.transpose(1, 2).is_contiguous()  # the layer's transpose(1, 2).reshape(B, S, H·Dh) is free


def test_causal_rows_ignore_the_future(device):
    q, k, v, _ = inputs((1, 2, 1, 20, 16), F32, device)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 12:] += 1.0
    v2[:, :, 12:] -= 1.0
    a, b = flash_attention(q, k, v), flash_attention(q, k2, v2)
    assert torch.equal(a[:, :, :12], b[:, :, :12])
    assert (a[:, :, 12:] - b[:, :, 12:]).abs().amax(dim=-1).min() > 1e-3


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(head_dim=8), "head_dim must be in 16..128"),
        (dict(kv_heads=3), "multiple of kv_heads"),
        (dict(dtype=F64), "fp16/bf16/fp32"),
    ],
)
def test_unsupported_inputs_raise(bad, match, device):
    dh, hkv, dtype = bad.get("head_dim", 16), bad.get("kv_heads", 2), bad.get("dtype", F32)
    q = torch.zeros(1, 4, 5, dh, device=device, dtype=dtype)
    kv = torch.zeros(1, hkv, 5, dh, device=device, dtype=dtype)
    with pytest.raises(ValueError, match=match):
        flash_attention(q, kv, kv)


def test_attention_layer_on_the_kernel(device):
    """The layer with impl="triton" equals the layer with impl="torch" (same weights), output and gradients."""
    torch.manual_seed(0)
    cfg = dict(n_heads=4, n_kv_heads=2, head_dim=16)
    layers = [
        Attention(32, AttentionConfig(**cfg, impl=impl), init_std=0.5, n_layers=2).to(device)
        for impl in ("torch", "triton")
    ]
    layers[1].load_state_dict(layers[0].state_dict())
    x = torch.randn(2, 37, 32, device=device)
    outs = []
    for layer in layers:
        out = layer(x)
        out.square().sum().backward()
        outs.append(out)
    torch.testing.assert_close(outs[1], outs[0], rtol=2e-5, atol=2e-5)
    for (name, p_torch), p_triton in zip(layers[0].named_parameters(), layers[1].parameters()):
        torch.testing.assert_close(p_triton.grad, p_torch.grad, rtol=1e-4, atol=1e-4, msg=name)


# Defined only on CUDA (rather than skipped elsewhere): the interpreter cannot measure device memory.
if ON_CUDA:

    def test_memory_grows_linearly_with_sequence_length():
        """No (seq, seq) matrix: forward + backward at seq 16384 needs a few O(seq·head_dim) buffers, where the
        bf16 score matrices of its 4 heads alone would take 2 GiB."""
        q, k, v, grad = inputs((1, 4, 4, 16384, 64), BF16, "cuda")
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        flash_attention(q, k, v).backward(grad)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - before
        assert extra < 16 * q.numel() * q.element_size(), f"{extra / 2**20:.0f} MiB above the inputs"


def _packed(batch: int, seq: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(document_ids, prefix) of `batch` rows of random document lengths (1 .. seq), each document's first
    tokens (up to half) its prompt."""
    g = torch.Generator().manual_seed(seed)
    docs, prefix = torch.zeros(batch, seq, dtype=torch.long), torch.zeros(batch, seq, dtype=torch.bool)
    for b in range(batch):
        pos, d = 0, 0
        while pos < seq:
            n = min(seq - pos, int(torch.randint(1, 60, (1,), generator=g)))
            docs[b, pos : pos + n] = d
            prefix[b, pos : pos + int(torch.randint(0, n // 2 + 1, (1,), generator=g))] = True
            pos, d = pos + n, d + 1
    return docs, prefix


@pytest.mark.parametrize("use_prefix", [False, True])
@pytest.mark.parametrize("shape", [(2, 4, 2, 150, 32), (1, 2, 1, 7, 16)])
def test_document_and_prefix_masks_match_reference(shape, use_prefix, device, within_torch_error):
    """Packed documents (and prefix-LM): output and gradients against the explicit masked softmax, in fp32;
    documents span several key tiles, so tiles are both skipped and partly masked."""
    q, k, v, grad = inputs(shape, F32, device)
    docs, prefix = _packed(shape[0], shape[3])
    kw = dict(document_ids=docs.to(device), prefix=prefix.to(device) if use_prefix else None)
    got = run(flash_attention, q, k, v, grad, **kw)
    base = run(masked_sdpa, q, k, v, grad, **kw)
    ref_kw = dict(document_ids=docs, prefix=prefix if use_prefix else None)
    ref = run(flash_attention_ref, *(t.double().cpu() for t in (q, k, v, grad)), **ref_kw)
    for name, a, b, r in zip(("out", "dq", "dk", "dv"), got, base, ref):
        assert torch.isfinite(a).all(), name
        within_torch_error(f"{name} {shape} documents prefix={use_prefix}", a, b, r)


def _allowed(docs: torch.Tensor, prefix: torch.Tensor, window) -> torch.Tensor:
    """(B, 1, S, S) bool, written out here: same document, and j <= i (within the window) or both in the prompt."""
    i, j = torch.arange(docs.shape[1])[:, None], torch.arange(docs.shape[1])[None, :]
    seen = (j <= i) & ((j > i - window) if window else True)
    return ((docs[:, :, None] == docs[:, None, :]) & (seen | (prefix[:, :, None] & prefix[:, None, :])))[:, None]


@pytest.mark.parametrize("kind", ATTENTION_MASKS)
def test_what_auto_takes_on_cuda_equals_sdpa_for_each_mask_kind(kind, device):
    """The path "auto" takes on CUDA for each mask kind (`attention_choice` with our kernel available), run here as
    the layer builds it (our kernel under the interpreter on CPU, or SDPA): output and gradients equal SDPA's with
    the mask written out, fp32, grouped heads, several documents per row."""
    choice = attention_choice("auto", "cuda", 16, None)[kind]
    kernel = attention_kernels("triton" if choice.name == "triton" else "torch", device, 16)[kind]
    assert kernel.name == ("triton" if choice.name == "triton" else "torch")
    q, k, v, grad = inputs((2, 4, 2, 48, 16), F32, device)
    lengths = [[5, 17, 1, 25], [30, 18]]
    docs = torch.tensor([sum(([d] * n for d, n in enumerate(row)), []) for row in lengths])
    prefix = torch.zeros_like(docs, dtype=torch.bool)
    prefix[0, :3], prefix[0, 5:12], prefix[1, :10], prefix[1, 30:31] = True, True, True, True
    window = 6 if kind == "window" else None
    masks = {
        "causal": {},
        "documents": dict(document_ids=docs),
        "prefix": dict(document_ids=docs, prefix=prefix),
        "window": dict(document_ids=docs, window=window),
    }[kind]
    got = run(kernel, q, k, v, grad, causal=True, **{n: t.to(device) if n != "window" else t for n, t in masks.items()})
    if kind == "causal":
        allowed = torch.ones(48, 48, dtype=torch.bool).tril().to(device)
    else:
        allowed = _allowed(docs, prefix if kind == "prefix" else torch.zeros_like(prefix), window).to(device)
    want = run(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True), q, k, v, grad
    )
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5, msg=f"{kind} {name}")


# A slice of queries (context parallelism): (q_offset, queries, keys) of a 100-position sequence: a head piece, a
# middle piece starting and ending inside tiles, a tail piece; keys up to the slice's end (all of them with prefix).
SLICES = [(0, 25, 25), (37, 45, 82), (75, 25, 100)]


@pytest.mark.parametrize("kind", ["causal", "documents", "prefix"])
@pytest.mark.parametrize("q_offset, m, n", SLICES, ids=str)
def test_query_slice_matches_sdpa_with_dense_mask(q_offset, m, n, kind, device):
    """Queries at positions q_offset .. q_offset + m − 1 against keys 0 .. n − 1, document ids over the whole
    sequence (no dense mask): output and gradients equal those rows of the whole-sequence SDPA with the dense mask
    written out (fp32, grouped heads; documents cross the slice's edges and tiles)."""
    S = 100
    q, k, v, grad = inputs((1, 4, 2, S, 16), F32, device, seed=5)
    docs, prefix = _packed(1, S, seed=2)
    if kind == "prefix":
        n = S  # a prompt can see prompt keys after it
    masks = {"causal": {}, "documents": dict(document_ids=docs), "prefix": dict(document_ids=docs, prefix=prefix)}
    masks = {name: t.to(device) for name, t in masks[kind].items()}
    rows = slice(q_offset, q_offset + m)
    allowed = torch.ones(S, S, dtype=torch.bool).tril()
    if kind != "causal":
        allowed = _allowed(docs, prefix if kind == "prefix" else torch.zeros_like(prefix), None)
    allowed = allowed.to(device)

    def dense(q, k, v):  # whole sequence, dense mask; gradients reach only through the slice's rows
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
        return out[:, :, rows]

    def sliced(q, k, v):
        return flash_attention(q[:, :, rows], k[:, :, :n], v[:, :, :n], q_offset=q_offset, **masks)

    got = run(sliced, q, k, v, grad[:, :, rows])
    want = run(dense, q, k, v, grad[:, :, rows])
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5, msg=f"{kind} {name}")


def test_query_slice_inputs_raise(device):
    q, kv = torch.zeros(1, 2, 5, 16, device=device), torch.zeros(1, 2, 9, 16, device=device)
    with pytest.raises(ValueError, match="document_ids must be"):  # shorter than the keys
        flash_attention(q, kv, kv, q_offset=4, document_ids=torch.zeros(1, 8, dtype=torch.long, device=device))
    with pytest.raises(ValueError, match="q_offset must be"):
        flash_attention(q, kv, kv, q_offset=-1)


@pytest.mark.parametrize("kind", ATTENTION_MASKS)
def test_what_auto_takes_on_cuda_under_cp_equals_the_whole_sequence(kind, device):
    """The context-parallel path as "auto" builds it on CUDA (`attention_cp_choice`: ours with a query offset, or
    SDPA by query blocks for windows), on a one-rank SeqShard (two pieces: the second's queries at offset S/2
    against all keys): output and gradients equal the layer without CP on SDPA (fp32, grouped heads, documents)."""
    choice = attention_cp_choice("auto", "cuda", 16, None)[kind]
    cfg = dict(n_heads=4, n_kv_heads=2, head_dim=16, mask="prefix", sliding_window=6 if kind == "window" else None)
    torch.manual_seed(0)
    ref = Attention(32, AttentionConfig(**cfg, impl="torch"), init_std=0.5, n_layers=2).to(device)
    layer = Attention(32, AttentionConfig(**cfg, impl="triton" if choice.name == "triton" else "torch"), 0.5, 2)
    layer = layer.to(device)
    layer.load_state_dict(ref.state_dict())
    assert layer.cp_kernels[kind].name == ("triton" if choice.name == "triton" else "torch")
    S = 48
    docs = torch.tensor([[0] * 5 + [1] * 17 + [2] * 2 + [3] * 24, [0] * 30 + [1] * 18], device=device)
    prefix = torch.zeros_like(docs, dtype=torch.bool)
    prefix[0, :3], prefix[0, 5:12], prefix[1, :10], prefix[1, 30:31] = True, True, True, True
    masks = {} if kind in ("causal", "window") else {"document_ids": docs}
    if kind == "prefix":
        masks["prefix"] = prefix
    x = torch.randn(2, S, 32, device=device)
    got, want = [], []
    for model, shard, out in ((layer, SeqShard(1, 0, S), got), (ref, None, want)):
        xs = x.clone().requires_grad_(True)
        y = model(xs, shard=shard, **masks)
        y.square().sum().backward()
        out += [y, xs.grad, *(p.grad for p in model.parameters())]
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=5e-5, atol=5e-5, msg=f"{kind} tensor {i}")
