"""The one place that turns a kernel choice, "auto" | "torch" | "triton", into a function.

Invariants: the choice is made once, when a layer is built for its device, never per call; "auto" is the PyTorch
path on every device but CUDA (there the layer's `auto_on_cuda`; attention per mask kind, `attention_choice`) and
never falls back behind the user's back: a kernel that cannot take its inputs raises a one-line ValueError, and a
CUDA choice that is a slow path carries its reason for start-up to print; a Triton kernel module is imported only
when "triton" is chosen and can run (Triton reads TRITON_INTERPRET at import), so CPU runs never import triton.
Rules in full: docs/kernels.md, section "Choosing an implementation"; tested in tests/kernels/test_kernel_choice.py.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch

IMPLS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class Kernel:
    """A resolved implementation: calling it runs `fn`; `name` says which one it is ("torch" or "triton");
    `slow` says why "auto" took the PyTorch path on CUDA where a kernel exists (start-up prints it), else None."""

    name: str
    fn: Callable
    slow: Optional[str] = None

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def triton_interpreting() -> bool:
    """TRITON_INTERPRET as Triton parses it: Triton kernels then run on CPU tensors, in numpy."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes", "y")


def _check_impl(impl: str, key: str) -> None:
    if impl not in IMPLS:
        quoted = [repr(c) for c in IMPLS]
        raise ValueError(f"{key}: expected {', '.join(quoted[:-1])} or {quoted[-1]}, got {impl!r}")


def why_no_triton(device: torch.device | str) -> Optional[str]:
    """Why the Triton kernels cannot run for a layer built for `device` (None: they can). The probe behind every
    choice here: whether the triton package is installed, and the device."""
    device = torch.device(device)
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed"
    if device.type == "cuda" or (device.type == "cpu" and triton_interpreting()):
        return None
    if device.type == "cpu":
        return (
            "the model is built for the CPU (TRITON_INTERPRET=1 runs the kernels in Triton's CPU interpreter, slowly)"
        )
    return f"the model is built for {device}; the Triton kernels run on CUDA"


def resolve(
    impl: str,
    key: str,
    device: torch.device | str,
    torch_fn: Callable,
    kernel: Optional[Callable[[], Callable]],
    what: str,
    why_not: Optional[str] = None,
    auto_on_cuda: str = "triton",
) -> Kernel:
    """The implementation of config value `impl` (of config key `key`) for a layer built for `device`.

    `torch_fn` is the PyTorch path; `kernel` loads the Triton function with the same signature (a zero-argument
    function that imports it from moe_dist.kernels, called only when it is chosen), or is None while the operation
    has no GPU kernel ("triton" is then refused); `what` names it in messages ("selective scan"); `why_not` says
    why the kernel cannot take this layer whatever the device (its library missing, shapes it does not take):
    "triton" is then refused with it, and "auto" on CUDA takes the PyTorch path with it as the slow-path reason.
    `auto_on_cuda`: what "auto" takes on CUDA (the layer's choice: attention's causal path is SDPA, "torch").
    """
    _check_impl(impl, key)
    device = torch.device(device)
    slow = None
    if impl == "auto":  # a CUDA machine without the triton package gets the PyTorch paths
        impl = auto_on_cuda if device.type == "cuda" and why_no_triton(device) is None else "torch"
        if impl == "triton" and kernel is not None and why_not is not None:
            impl, slow = "torch", f"the {what} takes the PyTorch path ({why_not})"
    if impl == "torch":
        return Kernel("torch", torch_fn, slow)
    if kernel is None:
        raise ValueError(f"{key}='triton': there is no Triton {what} kernel yet; use 'torch' or 'auto'")
    why_not = why_not or why_no_triton(device)
    if why_not is not None:
        raise ValueError(f"{key}='triton': the Triton {what} is not available: {why_not}")
    return Kernel("triton", kernel())


def recurrent_kernel(
    impl: str,
    key: str,
    device: torch.device | str,
    chunked: Callable,
    chunk_size: int,
    kernel: Callable[[], Callable],
    what: str,
    fla_key_dim: Optional[tuple[str, int]] = None,
) -> Kernel:
    """The scan of a recurrent mixer (Mamba-1's selective scan, Mamba-2's SSD, Gated DeltaNet's delta rule), with
    its oracle's signature (moe_dist.kernels.reference), as `resolve` chooses it for config key `key` = `impl`: the
    PyTorch path `chunked` run `chunk_size` timesteps per chunk, or the GPU kernel `kernel` loads. `fla_key_dim`,
    (config key, value) of the layer's key head size, where that kernel is fla-core's (`why_no_fla`)."""
    why_not = None if fla_key_dim is None else why_no_fla(fla_key_dim[1], fla_key_dim[0])
    return resolve(impl, key, device, functools.partial(chunked, chunk_size=chunk_size), kernel, what, why_not)


def why_no_fla(key_dim: int, dim_key: str) -> Optional[str]:
    """Why fla-core's kernels (moe_dist/layers/fla_ops.py) cannot take a layer whose key head size (the delta
    rule's dk, the SSD's state size) is `key_dim`, set by config key `dim_key` (None: they can)."""
    from moe_dist.layers.fla_ops import MAX_KEY_DIM

    if importlib.util.find_spec("fla") is None:
        return "the fla-core package is not installed: pip install 'moe_dist[fla]'"
    if key_dim > MAX_KEY_DIM:
        return f"{dim_key}={key_dim} is above {MAX_KEY_DIM}, the largest the fla kernels take"
    return None


# ------------------------------------------------------------------------------------------------ attention masks

ATTENTION_KEY = "model.attention.impl"
ATTENTION_MASKS = ("causal", "documents", "prefix", "window")
FLASH_HEAD_DIMS = (16, 128)  # the head sizes our Triton kernel takes (kernels/flash_attention.py)

# Attention is chosen per mask kind, since no one kernel is fast for all of them. What each candidate takes, for
# training (forward and backward, any number of grouped-query heads):
#
#   candidate                     causal  documents  prefix-LM  sliding window
#   SDPA, flash / cuDNN kernels   yes     -          -          -
#   SDPA with an explicit mask    yes     yes        yes        yes   (on CUDA its memory-efficient kernel with an
#                                                                      S x S mask, or, with grouped-query heads, its
#                                                                      math path: (B, H, S, S) scores in memory)
#   ours (Triton)                 yes     yes        yes        -     (head_dim 16..128; skips masked key tiles)
#   torch.nn.attention.varlen     yes     yes        -          yes   (CUDA only; its per-document offsets have a
#                                                                      data-dependent length: a host sync per layer)
#   FlexAttention                 yes     yes        yes        yes   (fast only compiled; nothing here compiles
#                                                                      at run time, and a block mask per batch)
#
# So on CUDA "auto" takes SDPA's own kernels for causal attention (ours runs at 0.52-0.65x their speed on an H200),
# ours for documents and prefix-LM, and SDPA with the explicit mask for a sliding window shorter than the sequence,
# the one kind that neither fast implementation here takes; where ours cannot run (no triton package, head_dim
# outside 16..128) documents and prefix-LM take the explicit mask too. Every CUDA choice that takes the explicit
# mask carries the reason, which start-up prints as a warning. varlen and FlexAttention stay out: neither is
# testable on CPU against SDPA, and a third implementation has to earn its place on hardware we can measure.
# Off CUDA, "auto" is SDPA for every kind; "triton" is ours wherever it can run, and SDPA for windows.
#
# Under context parallelism (`attention_cp_choice`) each rank's queries are pieces of the sequence at a global
# offset, attending to the gathered keys: SDPA's flash / cuDNN kernels take no query offset, so causal pieces take
# what documents take (ours with `q_offset`, else SDPA with an explicit mask one query block at a time, never a
# (S/cp x S) mask); the other kinds take what they take without CP.


@dataclass(frozen=True)
class AttentionPath:
    """The implementation one mask kind takes: "sdpa" or "triton"; `slow` says why it is a slow path on CUDA
    (SDPA with an explicit mask), None where it is a fast kernel or the device is not CUDA."""

    name: str
    slow: Optional[str] = None


def attention_mask_kind(documents: bool, prefix: bool, window: bool) -> str:
    """The mask kind of one call: `window` when a sliding window is shorter than the sequence (with or without
    documents), else prefix-LM over documents, else documents, else plain causal."""
    return "window" if window else "prefix" if prefix else "documents" if documents else "causal"


def attention_choice(
    impl: str, device: torch.device | str, head_dim: int, why_no_triton: Optional[str]
) -> dict[str, AttentionPath]:
    """Mask kind → the path `model.attention.impl` = `impl` takes for a layer built for `device` with heads of
    `head_dim`; a pure function of its arguments, `why_no_triton` being the probe's answer for that device
    (`why_no_triton(device)`). "triton" where ours cannot run is a one-line ValueError naming the key."""
    return _attention_paths(impl, device, head_dim, why_no_triton, cp=False)


def attention_cp_choice(
    impl: str, device: torch.device | str, head_dim: int, why_no_triton: Optional[str]
) -> dict[str, AttentionPath]:
    """`attention_choice` for the context-parallel path (query pieces at a global offset against the gathered
    keys): causal pieces take what documents take, since SDPA's own causal kernels take no query offset."""
    return _attention_paths(impl, device, head_dim, why_no_triton, cp=True)


def _attention_paths(
    impl: str, device: torch.device | str, head_dim: int, why_no_triton: Optional[str], cp: bool
) -> dict[str, AttentionPath]:
    _check_impl(impl, ATTENTION_KEY)
    device = torch.device(device)
    lo, hi = FLASH_HEAD_DIMS
    why_not_ours = why_no_triton or (None if lo <= head_dim <= hi else f"head_dim {head_dim} is outside {lo}..{hi}")
    if impl == "triton" and why_not_ours is not None:
        raise ValueError(
            f"{ATTENTION_KEY}='triton': the Triton flash-attention kernel is not available: {why_not_ours}"
        )
    cuda = device.type == "cuda"
    under = " under context parallelism" if cp else ""

    def sdpa(kind: str, why: str) -> AttentionPath:  # a masked kind on SDPA: slow on CUDA
        slow = f"attention with {kind}{under} takes SDPA with an explicit mask ({why})"
        return AttentionPath("sdpa", slow if cuda else None)

    window = sdpa("a sliding window shorter than the sequence", "no fast kernel here takes a sliding window")
    if impl == "triton" or (impl == "auto" and cuda and why_not_ours is None):
        ours = AttentionPath("triton")
        causal = ours if impl == "triton" or cp else AttentionPath("sdpa")
        return {"causal": causal, "documents": ours, "prefix": ours, "window": window}
    why = f"{ATTENTION_KEY}='torch'" if impl == "torch" else f"the Triton kernel cannot run: {why_not_ours}"
    return {
        "causal": sdpa("a causal mask", why) if cp else AttentionPath("sdpa"),
        "documents": sdpa("documents", why),
        "prefix": sdpa("prefix-LM", why),
        "window": window,
    }
