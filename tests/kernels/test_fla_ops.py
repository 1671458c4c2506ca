"""fla-core's chunked kernels behind our signatures (moe_dist/layers/fla_ops.py) against the step-by-step oracles:
outputs, final states and every input gradient, with packed documents and initial states; and the two mixers
built with impl "triton" against the same mixers on their PyTorch paths (outputs and parameter gradients, and
cached decoding against the full forward); bf16 activations within the PyTorch paths' error.

Runs under TRITON_INTERPRET=1 on CPU or on CUDA (see conftest.py); skipped where fla-core is not installed (the
optional extra `fla`). Under the interpreter two things differ from compiled Triton, and `_interpreter_shims`
gives the compiled behaviour, test-only (fla's kernels are unchanged):
- loop counters: compiled Triton makes `for i in range(n)` counters int32 scalars, which fla casts
  (`i_t.to(tl.int64)`); the interpreter gives Python ints, which have no `.to`;
- autotuning benchmarks every config with the GPU driver's timer, which the interpreter has not: one config runs.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from moe_dist.kernels.reference import gated_delta_rule_ref, ssd_scan_ref

from moe_dist.layers.kernel_choice import triton_interpreting

pytest.importorskip("fla", reason="fla-core (the optional extra `fla`) is not installed")


class _Counter(int):
    """A loop counter that also casts like compiled Triton's int32 scalar."""

    def to(self, dtype, **_):
        import triton.language as tl
        from triton.runtime.interpreter import TensorHandle

        np_dtype = {tl.int32: np.int32, tl.int64: np.int64}[dtype]
        return tl.tensor(TensorHandle(np.array(int(self), dtype=np_dtype), dtype), dtype)


def _counting_range(*args):
    return (_Counter(i) for i in range(*args))


@pytest.fixture(scope="module", autouse=True)
def _interpreter_shims():
    if not triton_interpreting():
        yield
        return
    import fla.ops.gated_delta_rule  # noqa: F401  (imports every kernel module these tests run)
    import fla.ops.simple_gla  # noqa: F401
    from triton.runtime.autotuner import Autotuner

    patch = pytest.MonkeyPatch()
    prune = Autotuner.prune_configs
    patch.setattr(Autotuner, "prune_configs", lambda self, kwargs: prune(self, kwargs)[:1])
    for name, module in list(sys.modules.items()):
        if name.startswith("fla.") and module is not None:
            patch.setattr(module, "range", _counting_range, raising=False)
    yield
    patch.undo()


def _resets(batch: int, seqlen: int) -> torch.Tensor:
    """Row 0: documents starting at 5 and 23; row 1: a document at t = 0 (drops the initial state) and at 30."""
    reset = torch.zeros(batch, seqlen, dtype=torch.bool)
    reset[0, [5, 23]] = True
    reset[1, [0, 30]] = True
    return reset


def _check(fn, ref, inputs: dict, device, atol: float) -> None:
    """fn and ref on the same leaves: outputs, final states and the gradients of a random projection of both."""
    leaves = {k: v.detach().to(device).requires_grad_(v.is_floating_point()) for k, v in inputs.items()}
    ref_leaves = {k: v.detach().double().requires_grad_(v.is_floating_point()) for k, v in inputs.items()}
    for key in ("reset",):
        if key in inputs:
            leaves[key], ref_leaves[key] = inputs[key].to(device), inputs[key]
    out, state = fn(**leaves)
    ref_out, ref_state = ref(**ref_leaves)
    torch.testing.assert_close(out.double().cpu(), ref_out, atol=atol, rtol=0)
    torch.testing.assert_close(state.double().cpu(), ref_state, atol=atol, rtol=0)
    g = torch.Generator().manual_seed(3)
    w_out, w_state = (torch.randn(t.shape, generator=g, dtype=torch.float64) for t in (ref_out, ref_state))
    ((out.double() * w_out.to(device)).sum() + (state.double() * w_state.to(device)).sum()).backward()
    ((ref_out * w_out).sum() + (ref_state * w_state).sum()).backward()
    for key, leaf in leaves.items():
        if leaf.requires_grad:
            assert leaf.grad is not None, key
            torch.testing.assert_close(leaf.grad.double().cpu(), ref_leaves[key].grad, atol=atol, rtol=0, msg=key)


@pytest.mark.parametrize("documents", [False, True])
def test_gated_delta_rule_matches_the_reference(documents, device):
    from moe_dist.layers.fla_ops import fla_gated_delta_rule

    torch.manual_seed(0)
    batch, seqlen, heads, dk, dv = 2, 70, 2, 16, 32  # two of fla's 64-step chunks
    inputs = {
        "q": torch.randn(batch, seqlen, heads, dk),
        "k": torch.nn.functional.normalize(torch.randn(batch, seqlen, heads, dk), dim=-1),
        "v": torch.randn(batch, seqlen, heads, dv),
        "g": -0.3 * torch.rand(batch, seqlen, heads),
        "beta": torch.rand(batch, seqlen, heads),
        "initial_state": 0.5 * torch.randn(batch, heads, dk, dv),
    }
    if documents:
        inputs["reset"] = _resets(batch, seqlen)
    _check(fla_gated_delta_rule, gated_delta_rule_ref, inputs, device, atol=2e-4)


@pytest.mark.parametrize("documents", [False, True])
def test_ssd_matches_the_reference(documents, device):
    from moe_dist.layers.fla_ops import fla_ssd_scan

    torch.manual_seed(0)
    batch, seqlen, heads, groups, head_dim, d_state = 2, 70, 4, 2, 16, 16
    inputs = {
        "x": torch.randn(batch, seqlen, heads, head_dim),
        "dt": 0.05 + 0.2 * torch.rand(batch, seqlen, heads),
        "A": -torch.linspace(0.5, 4.0, heads),
        "B": torch.randn(batch, seqlen, groups, d_state),
        "C": torch.randn(batch, seqlen, groups, d_state),
        "D": torch.randn(heads),
        "initial_state": 0.5 * torch.randn(batch, heads, head_dim, d_state),
    }
    if documents:
        inputs["reset"] = _resets(batch, seqlen)
    _check(fla_ssd_scan, ssd_scan_ref, inputs, device, atol=2e-4)


def _mixer_pair(kind: str, device):
    """The same random mixer twice, on fla's kernels and on the PyTorch path (fp32)."""
    from moe_dist.config import GDNConfig, Mamba2Config
    from moe_dist.layers.gdn import GatedDeltaNet
    from moe_dist.layers.mamba2 import Mamba2

    layers = []
    for impl in ("triton", "torch"):
        torch.manual_seed(0)
        if kind == "gdn":
            cfg = GDNConfig(n_k_heads=1, n_v_heads=2, head_k_dim=16, head_v_dim=16, impl=impl)
            layer = GatedDeltaNet(32, cfg, norm_eps=1e-5, init_std=0.1, device=device)
        else:
            cfg = Mamba2Config(d_state=16, head_dim=16, n_groups=1, chunk_size=16, impl=impl)
            layer = Mamba2(32, cfg, norm_eps=1e-5, init_std=0.1, device=device)
        layer.init_weights()
        layers.append(layer.to(device))
    assert [next(iter(layer.implementations.values())) for layer in layers] == ["triton", "torch"]
    return layers


@pytest.mark.parametrize("kind", ["gdn", "mamba2"])
def test_mixers_on_fla_equal_the_pytorch_paths(kind, device):
    kernel, torch_path = _mixer_pair(kind, device)
    x = torch.randn(2, 40, 32, device=device)
    document_ids = torch.zeros(2, 40, dtype=torch.long, device=device)
    document_ids[0, 17:] = 1
    document_ids[1, 3:] = 1
    outs = []
    for layer in (kernel, torch_path):
        out = layer(x, document_ids=document_ids)
        out.square().sum().backward()
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)
    for (name, p), q in zip(kernel.named_parameters(), torch_path.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-3, msg=name)


# Under the interpreter fla's gated delta rule gives NaNs in bf16 (numpy's warnings point at elementwise multiplies
# and dots; Triton's interpreter does not support bf16, conftest.py patches only its dots): this case runs on CUDA.
BF16_GDN = pytest.param(
    "gdn", marks=pytest.mark.skipif(triton_interpreting(), reason="bf16 elementwise math in Triton's interpreter")
)


@pytest.mark.parametrize("kind", [BF16_GDN, "mamba2"])
def test_bf16_activations_within_the_pytorch_paths_error(kind, device, within_torch_error):
    """bf16 q, k, v / x, B, C (fp32 decays): the kernel's error against the fp64 oracle is PyTorch's own."""
    from moe_dist.layers.delta_rule import chunk_gated_delta_rule
    from moe_dist.layers.fla_ops import fla_gated_delta_rule, fla_ssd_scan
    from moe_dist.layers.ssd import ssd_scan

    torch.manual_seed(0)
    batch, seqlen, heads, dk, dv = 1, 70, 2, 16, 16
    reset = _resets(2, seqlen)[1:]
    if kind == "gdn":
        k = torch.nn.functional.normalize(torch.randn(batch, seqlen, heads, dk), dim=-1)
        args = [torch.randn(batch, seqlen, heads, dk), k, torch.randn(batch, seqlen, heads, dv)]
        rest = [-0.3 * torch.rand(batch, seqlen, heads), torch.rand(batch, seqlen, heads)]
        fn, torch_fn, ref = fla_gated_delta_rule, chunk_gated_delta_rule, gated_delta_rule_ref
    else:
        args = [torch.randn(batch, seqlen, heads, dv)]
        rest = [0.05 + 0.2 * torch.rand(batch, seqlen, heads), -torch.linspace(0.5, 4.0, heads)]
        rest += [torch.randn(batch, seqlen, 1, dk), torch.randn(batch, seqlen, 1, dk)]
        fn, torch_fn, ref = fla_ssd_scan, ssd_scan, ssd_scan_ref
    bf16 = [t.bfloat16() for t in args] + rest if kind == "gdn" else [args[0].bfloat16(), *rest[:2]]
    if kind == "mamba2":
        bf16 += [t.bfloat16() for t in rest[2:]]
    want, _ = ref(*[t.double() for t in args + rest], reset=reset)
    torch_out, _ = torch_fn(*bf16, reset=reset)
    out, state = fn(*[t.to(device) for t in bf16], reset=reset.to(device))
    assert state.dtype == torch.float32
    within_torch_error("out", out.cpu(), torch_out, want)


@pytest.mark.parametrize("kind", ["gdn", "mamba2"])
def test_cached_steps_on_fla_equal_the_full_forward(kind, device):
    """Generation on the kernels: a prompt, then one position per call through the cache (the state passed in as
    the initial state), equals the whole sequence at once."""
    layer, _ = _mixer_pair(kind, device)
    x = torch.randn(2, 9, 32, device=device)
    with torch.no_grad():
        state = layer.new_state(2, x.device, x.dtype)
        outs = [layer(x[:, :5], cache=state)] + [layer(x[:, t : t + 1], cache=state) for t in range(5, 9)]
        torch.testing.assert_close(torch.cat(outs, 1), layer(x), atol=1e-5, rtol=1e-5)
