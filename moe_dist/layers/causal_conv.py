"""The causal depthwise convolution of the recurrent mixers (Mamba-1, Mamba-2, Gated DeltaNet), with packed
documents and the inference cache: output t mixes inputs t − K + 1 … t of its channel (K taps), never a later one.

Weights are laid out as nn.Conv1d's depthwise ones, (C, 1, K) with tap K − 1 the current input, so the layers
keep their `conv1d` modules (checkpoint names follow Hugging Face) and pass `conv1d.weight` and `conv1d.bias`.
The activation after the conv is the mixer's. Tested in tests/layers/test_causal_conv.py.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def causal_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    document_ids: Optional[torch.Tensor] = None,
    primed: bool = False,
) -> torch.Tensor:
    """The causal depthwise conv of x (B, C, L) with `weight` (C, 1, K) and `bias` (C,) or None.

    Without `primed` the inputs before x are zeros and the output is (B, C, L). With `primed` x starts with the
    K − 1 inputs that precede its first output (a context-parallel halo, the inference cache's window), which the
    output (B, C, L − K + 1) leaves out. `document_ids` (B, L) int, over x's positions: tap j (input t − j)
    counts only where t − j is in t's document, so the conv window restarts at each document start.
    """
    K, L = weight.shape[-1], x.shape[-1]
    if document_ids is None:
        if primed:
            return F.conv1d(x, weight, bias, groups=weight.shape[0])
        # nn.Conv1d(padding=K − 1)'s own call, its right padding dropped: bitwise the layers' conv1d modules.
        return F.conv1d(x, weight, bias, padding=K - 1, groups=weight.shape[0])[..., :L]
    # K shifted products (K is 4 in every shipped config): F.conv1d has no per-position mask.
    w = weight[:, 0]  # (C, K)
    out = x * w[:, K - 1, None]
    for j in range(1, min(K, L)):
        same = (document_ids[:, j:] == document_ids[:, :-j])[:, None]  # (B, 1, L − j)
        out[..., j:] = out[..., j:] + x[..., :-j] * w[:, K - 1 - j, None] * same
    if bias is not None:
        out = out + bias[:, None]
    return out[..., K - 1 :] if primed else out


def causal_conv_step(
    window: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One inference call of the causal conv: `window` (B, C, K − 1), the last K − 1 inputs so far (oldest first,
    zeros before the first position), continued by x (B, C, L), L ≥ 1 new positions (the prompt, then one per
    step). Returns the conv output (B, C, L), equal to the full sequence's last L positions, and the next window
    (B, C, K − 1)."""
    inputs = torch.cat([window, x], dim=-1)  # (B, C, K − 1 + L)
    # Sliced from the end by length, not [-(K − 1):]: with K = 1 the window is empty.
    return causal_conv(inputs, weight, bias, primed=True), inputs[..., inputs.shape[-1] - window.shape[-1] :]
