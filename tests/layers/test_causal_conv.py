"""The recurrent mixers' causal depthwise conv (moe_dist.layers.causal_conv): bitwise nn.Conv1d without documents,
equal to a per-document loop with them, a primed window (context-parallel halo) equal to the full sequence's tail,
and the inference cache's step equal to the full conv, piece by piece."""

import pytest
import torch
from torch import nn

from moe_dist.layers.causal_conv import causal_conv, causal_conv_step

C = 6


def conv1d(K, bias, seed=0):
    torch.manual_seed(seed)
    conv = nn.Conv1d(C, C, K, groups=C, padding=K - 1, bias=bias).double()
    if bias:
        with torch.no_grad():
            conv.bias.normal_()  # nn.Conv1d's default bias init is small: make a bias mistake visible
    return conv


def documents(lengths_per_row):
    """(B, L) document ids from each row's document lengths, numbered per row."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(n)), torch.tensor(n)) for n in lengths_per_row])


@pytest.mark.parametrize("K", [1, 2, 4])
@pytest.mark.parametrize("bias", [True, False])
def test_without_documents_it_is_the_conv1d_module_bitwise(K, bias):
    for dtype in (torch.float64, torch.float32):
        conv, x = conv1d(K, bias).to(dtype), torch.randn(2, C, 9, dtype=dtype)
        assert torch.equal(causal_conv(x, conv.weight, conv.bias), conv(x)[..., :9])


@pytest.mark.parametrize("K", [1, 2, 4])
@pytest.mark.parametrize("bias", [True, False])
def test_documents_restart_the_window_as_a_loop_over_documents(K, bias):
    """Each document convolved alone from zeros (the reference), against one call over the packed rows; lengths
    include documents shorter than the kernel and a row of one document."""
    lengths = [[3, 1, 5, 2], [11]]
    ids = documents(lengths)
    conv, x = conv1d(K, bias), torch.randn(2, C, 11, dtype=torch.float64)
    out = causal_conv(x, conv.weight, conv.bias, ids)
    rows = [[conv(doc)[..., : doc.shape[-1]] for doc in x[b : b + 1].split(n, dim=-1)] for b, n in enumerate(lengths)]
    expected = torch.cat([torch.cat(docs, dim=-1) for docs in rows])  # (B, C, L)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    # One document per row is the plain conv.
    same = torch.zeros_like(ids)
    torch.testing.assert_close(causal_conv(x, conv.weight, conv.bias, same), conv(x)[..., :11], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("with_documents", [False, True])
def test_a_primed_window_is_the_tail_of_the_whole_sequence(with_documents):
    """x prefixed by the K − 1 inputs before it (a context-parallel halo) gives the whole sequence's outputs at
    x's positions, with or without document ids over the window."""
    K, L, c = 4, 12, 5
    conv, x = conv1d(K, True), torch.randn(2, C, L, dtype=torch.float64)
    ids = documents([[4, 3, 5], [2, 2, 8]]) if with_documents else None
    whole = causal_conv(x, conv.weight, conv.bias, ids)
    window = x[..., L - c - (K - 1) :]
    window_ids = None if ids is None else ids[:, L - c - (K - 1) :]
    torch.testing.assert_close(
        causal_conv(window, conv.weight, conv.bias, window_ids, primed=True), whole[..., L - c :], rtol=0, atol=0
    )


@pytest.mark.parametrize("K", [1, 2, 4])
@pytest.mark.parametrize("bias", [True, False])
def test_the_cache_step_continues_the_full_conv(K, bias):
    """A prompt, then one position per step (and a 3-position piece), from a zero window: the outputs are the full
    conv's and the window always holds the last K − 1 inputs, oldest first."""
    conv, x = conv1d(K, bias), torch.randn(2, C, 10, dtype=torch.float64)
    whole = conv(x)[..., :10]
    window, start = torch.zeros(2, C, K - 1, dtype=torch.float64), 0
    for length in (4, 1, 1, 3, 1):
        out, window = causal_conv_step(window, x[..., start : start + length], conv.weight, conv.bias)
        start += length
        torch.testing.assert_close(out, whole[..., start - length : start], rtol=1e-12, atol=1e-12)
        assert window.shape == (2, C, K - 1)
        seen = torch.cat([torch.zeros(2, C, K - 1, dtype=torch.float64), x[..., :start]], dim=-1)
        assert torch.equal(window, seen[..., seen.shape[-1] - (K - 1) :])
