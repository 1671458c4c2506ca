"""The "auto" / "torch" / "triton" / "cpu" choice (moe_dist.layers.impl) and the plain-PyTorch references it falls back to.

Runs in the plain test process, where no kernel module may be imported under a faked environment: the Triton
side is replaced by recording fakes wherever a test pretends to have CUDA or the interpreter. On a CUDA machine
the last tests also check the real "auto" dispatch.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import moe_dist.layers.impl as impl
from moe_dist.kernels.reference import flash_attention_ref, permute_tokens_ref, unpermute_tokens_ref
from moe_dist.layers.attention import attention_kernel
from moe_dist.layers.mamba import select_scan
from moe_dist.layers.mlp import gated_silu, select_gated_silu
from moe_dist.layers.moe import Permutation


def torch_path(x, *args, **kwargs):
    return ("torch", x)


def fake_triton(calls):
    """A stand-in for impl._load: the kernel records its calls; it supports only fp32 inputs."""

    def kernel(x, *args, **kwargs):
        calls.append(x)
        return ("triton", x)

    def unsupported(x, *args, **kwargs):
        return None if x.dtype == torch.float32 else "fp32 only"

    return lambda name: (kernel, unsupported)


@pytest.fixture
def cpu_only(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_torch_is_the_torch_function(cpu_only):
    assert impl.resolve("torch", "model.x.impl", "kernel", torch_path, "m.f") is torch_path


def test_auto_without_cuda_is_the_torch_function_and_imports_no_kernel(cpu_only, monkeypatch):
    monkeypatch.setattr(impl, "_load", lambda name: pytest.fail("auto on a CPU-only machine loaded a kernel"))
    assert impl.resolve("auto", "model.x.impl", "kernel", torch_path, "m.f") is torch_path
    assert attention_kernel("auto") is attention_kernel("torch")


@pytest.mark.parametrize("key, build", [
    ("model.attention.impl", lambda: attention_kernel("triton")),
    ("model.mamba.impl", lambda: select_scan("triton", 16)),
    ("model.moe.impl", lambda: Permutation.from_impl("triton")),
])
def test_triton_without_cuda_is_a_one_line_error_naming_the_key(key, build, cpu_only):
    with pytest.raises(ValueError) as err:
        build()
    msg = str(err.value)
    assert msg.startswith(f"{key}='triton'") and "no CUDA device" in msg and "TRITON_INTERPRET=1" in msg
    assert "\n" not in msg


def test_triton_without_the_package(monkeypatch):
    real_find_spec = impl.importlib.util.find_spec
    monkeypatch.setattr(impl.importlib.util, "find_spec",
                        lambda name, *a: None if name == "triton" else real_find_spec(name, *a))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match=r"model\.x\.impl='triton': .*triton package is not installed"):
        impl.resolve("triton", "model.x.impl", "kernel", torch_path, "m.f")
    assert impl.resolve("auto", "model.x.impl", "kernel", torch_path, "m.f") is torch_path


def test_unknown_choice_names_the_key():
    with pytest.raises(ValueError, match=r"model\.mamba\.impl: expected 'auto', 'torch', 'triton' or 'cpu', got 'cuda'"):
        select_scan("cuda", 16)
    with pytest.raises(ValueError, match=r"model\.attention\.impl: expected 'auto', 'torch' or 'triton', got 'cpu'"):
        attention_kernel("cpu")


CPU = impl.IMPLS_WITH_CPU


def fake_cpu_kernel(calls, why_unavailable=None):
    """A compiled CPU kernel stand-in: records its calls, takes fp32 CPU tensors only."""

    def kernel(x, *args, **kwargs):
        calls.append(x)
        return ("cpu", x)

    def unsupported(x, *args, **kwargs):
        return None if x.device.type == "cpu" and x.dtype == torch.float32 else "fp32 CPU tensors only"

    return impl.CpuKernel(kernel, unsupported, lambda: why_unavailable)


def test_auto_sends_supported_cpu_tensors_to_the_cpu_kernel(cpu_only, monkeypatch):
    monkeypatch.setattr(impl, "_load", lambda name: pytest.fail("auto on a CPU-only machine loaded a Triton kernel"))
    calls = []
    fn = impl.resolve("auto", "model.x.impl", "kernel", torch_path, "m.f", fake_cpu_kernel(calls), CPU)
    x32, x64, meta = torch.zeros(2), torch.zeros(2, dtype=torch.float64), torch.zeros(2, device="meta")
    assert fn(x32) == ("cpu", x32) and fn(x=x32) == ("cpu", x32)
    assert fn(x64) == ("torch", x64) and fn(meta) == ("torch", meta)
    assert calls == [x32, x32]


def test_auto_with_cuda_and_a_cpu_kernel_routes_by_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(impl, "_why_no_triton", lambda: None)
    triton_calls, cpu_calls = [], []
    monkeypatch.setattr(impl, "_load", fake_triton(triton_calls))
    fn = impl.resolve("auto", "model.x.impl", "kernel", torch_path, "m.f", fake_cpu_kernel(cpu_calls), CPU)
    x = torch.zeros(2)
    assert fn(x) == ("cpu", x) and cpu_calls == [x] and triton_calls == []


def test_cpu_choice_errors_name_the_key(cpu_only):
    calls = []
    fn = impl.resolve("cpu", "model.x.impl", "kernel", torch_path, "m.f", fake_cpu_kernel(calls), CPU)
    x = torch.zeros(2)
    assert fn(x) == ("cpu", x) and calls == [x]
    with pytest.raises(ValueError, match=r"^model\.x\.impl='cpu': fp32 CPU tensors only$"):
        fn(x.double())
    with pytest.raises(ValueError, match=r"^model\.x\.impl='cpu': the compiled CPU kernel is not available here: "
                                         r"no compiler$"):
        impl.resolve("cpu", "model.x.impl", "kernel", torch_path, "m.f", fake_cpu_kernel([], "no compiler"), CPU)


def test_a_part_without_a_kernel_of_the_chosen_family_runs_its_torch_path(cpu_only):
    """model.moe.impl names a kernel family: the gated SiLU has no Triton kernel (the permutation has both)."""
    assert impl.resolve("cpu", "model.x.impl", "kernel", torch_path, "m.f", None, CPU) is torch_path
    assert impl.resolve("triton", "model.x.impl", "kernel", torch_path, None, fake_cpu_kernel([]), CPU) is torch_path
    assert select_gated_silu("triton") is gated_silu
    with pytest.raises(ValueError, match=r"model\.x\.impl: expected 'auto', 'torch' or 'triton', got 'cpu'"):
        impl.resolve("cpu", "model.x.impl", "kernel", torch_path, "m.f", fake_cpu_kernel([]))


def test_auto_without_a_buildable_cpu_kernel_warns_and_is_the_torch_function(cpu_only):
    with pytest.warns(UserWarning, match=r"model\.x\.impl='auto': the compiled CPU kernel is not available "
                                         r"\(no compiler\); CPU tensors take the PyTorch path"):
        fn = impl.resolve("auto", "model.x.impl", "kernel", torch_path, "m.f", fake_cpu_kernel([], "no compiler"), CPU)
    assert fn is torch_path


def test_triton_under_the_interpreter_takes_cpu_tensors_only(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = []
    monkeypatch.setattr(impl, "_load", fake_triton(calls))
    fn = impl.resolve("triton", "model.x.impl", "kernel", torch_path, "m.f")
    x = torch.zeros(2)
    assert fn(x) == ("triton", x) and calls == [x]
    with pytest.raises(ValueError, match=r"model\.x\.impl='triton': the Triton kernel got meta tensors"):
        fn(torch.zeros(2, device="meta"))


def test_auto_with_cuda_sends_non_cuda_tensors_to_torch(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    calls = []
    monkeypatch.setattr(impl, "_load", fake_triton(calls))
    fn = impl.resolve("auto", "model.x.impl", "kernel", torch_path, "m.f")
    x = torch.zeros(2)
    assert fn(x) == ("torch", x) and fn(x=x) == ("torch", x) and calls == []


# ------------------------------------------------------------------------------------------------ references


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hq, hkv, seq", [(4, 4, 1), (4, 2, 7), (6, 1, 33)])
def test_flash_attention_ref_is_sdpa(hq, hkv, seq, causal):
    q, k, v = (torch.randn(2, h, seq, 16, dtype=torch.float64) for h in (hq, hkv, hkv))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hq != hkv)
    torch.testing.assert_close(flash_attention_ref(q, k, v, causal=causal), want, rtol=1e-12, atol=1e-12)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hq != hkv, scale=0.3)
    torch.testing.assert_close(flash_attention_ref(q, k, v, causal, 0.3), want, rtol=1e-12, atol=1e-12)


def test_flash_attention_ref_keeps_dtype_and_computes_in_fp32():
    q = torch.randn(1, 2, 5, 16).bfloat16()
    out = flash_attention_ref(q, q[:, :1], q[:, :1])
    assert out.dtype == torch.bfloat16
    want = flash_attention_ref(q.float(), q[:, :1].float(), q[:, :1].float()).bfloat16()
    assert torch.equal(out, want)


def test_permutation_refs_by_explicit_loops():
    T, K, D = 5, 2, 3
    x_TD = torch.randn(T, D, dtype=torch.float64)
    rows_R = torch.tensor([7, 0, 3, 9, 1])  # assignments a = k·T + t, dropped ones absent
    weight_A = torch.rand(K * T, dtype=torch.float64)
    x_RD = permute_tokens_ref(x_TD, rows_R, K)
    for r, a in enumerate(rows_R.tolist()):
        assert torch.equal(x_RD[r], x_TD[a % T])
    y_RD = torch.randn(len(rows_R), D, dtype=torch.float64)
    want = torch.zeros(T, D, dtype=torch.float64)
    for r, a in enumerate(rows_R.tolist()):
        want[a % T] += weight_A[a] * y_RD[r]
    torch.testing.assert_close(unpermute_tokens_ref(y_RD, rows_R, weight_A, T), want, rtol=1e-14, atol=1e-14)


# ------------------------------------------------------------------------------------------------ CUDA only
# Defined only where a GPU exists (rather than skipped everywhere else): "auto" picks per call by device and support.

if torch.cuda.is_available():

    def test_auto_on_cuda_runs_the_kernel_when_supported():
        from moe_dist.kernels.flash_attention import flash_attention

        fn = attention_kernel("auto")
        q = torch.randn(1, 4, 64, 32, device="cuda", dtype=torch.bfloat16)
        kv = torch.randn(1, 2, 64, 32, device="cuda", dtype=torch.bfloat16)
        assert torch.equal(fn(q, kv, kv, causal=True), flash_attention(q, kv, kv, causal=True))
        q8, kv8 = q[..., :8].contiguous(), kv[..., :8].contiguous()  # head_dim 8: unsupported → SDPA
        want = F.scaled_dot_product_attention(q8, kv8, kv8, is_causal=True, enable_gqa=True)
        assert torch.equal(fn(q8, kv8, kv8, causal=True), want)
        assert math.isfinite(fn(q.cpu(), kv.cpu(), kv.cpu()).float().sum().item())  # CPU tensors: SDPA
