"""cpu_vec.h's two forms of the vector loads and stores give the same bits: the kernels as loaded (AVX-512 masked
loads and stores, VCVTNEPS2BF16, on CPUs with AVX512-BF16) against the same sources built with -mno-avx512bf16,
which takes the portable forms. Rows that end in a partial vector, NaN inputs, dropped assignments."""

import ctypes
import subprocess

import pytest
import torch

from moe_dist.kernels import cpu_build, gated_silu_cpu, permute_cpu


@pytest.fixture(scope="module")
def portable(tmp_path_factory):
    """name -> the kernel built with the portable loads and stores (argtypes as the package sets them)."""
    compiler, _ = cpu_build._compiler("c++")
    libs = {}
    for module, name in ((gated_silu_cpu, "gated_silu_cpu"), (permute_cpu, "permute_cpu")):
        out = tmp_path_factory.mktemp("portable") / f"{name}.so"
        subprocess.run([compiler, *cpu_build.FLAGS, "-mno-avx512bf16", f"-I{cpu_build.HERE}",
                        str(cpu_build.HERE / f"{name}.cpp"), "-o", str(out)], check=True, capture_output=True)
        lib = ctypes.CDLL(str(out))
        for fn, argtypes in module._SIGNATURES:
            getattr(lib, fn).argtypes = list(argtypes)
        libs[name] = lib
    return libs


def same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal bit patterns, except that a NaN only has to be a NaN (its sign and payload may differ)."""
    as_int = (lambda t: t.view(torch.int16)) if want.dtype == torch.bfloat16 else (lambda t: t.view(torch.int32))
    nan = torch.isnan(want)
    return torch.equal(torch.isnan(got), nan) and torch.equal(as_int(got)[~nan], as_int(want)[~nan])


def inputs(shape, dtype, seed):
    x = (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)
    x.view(-1)[::37] = float("nan")
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows, half", [(5, 17), (3, 40), (64, 256)])  # tails of 1 and 8 lanes; whole vectors
def test_gated_silu_same_bits(portable, dtype, rows, half):
    fast, _ = gated_silu_cpu._library()
    ab, dh = inputs((rows, 2 * half), dtype, 0), inputs((rows, half), dtype, 1)
    results = []
    for lib in (fast, portable["gated_silu_cpu"]):
        h, dab = ab.new_empty(rows, half), torch.empty_like(ab)
        lib.gated_silu_fwd(rows, half, dtype == torch.bfloat16, ab.data_ptr(), h.data_ptr(), 2)
        lib.gated_silu_bwd(rows, half, dtype == torch.bfloat16, ab.data_ptr(), dh.data_ptr(), dab.data_ptr(), 2)
        results.append((h, dab))
    for got, want in zip(*results):
        assert torch.isnan(want).any() and torch.isfinite(want).any()
        assert same_bits(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("D", [24, 512])
def test_combine_and_its_backward_same_bits(portable, dtype, D):
    fast, _ = permute_cpu._library()
    T, K = 33, 3
    g = torch.Generator().manual_seed(2)
    row_of = torch.randperm(T * K, generator=g)
    row_of[::5] = -1  # dropped assignments
    rows, grad_out = inputs((T * K, D), dtype, 3), inputs((T, D), dtype, 4)
    weight = torch.rand(T * K, generator=g)
    results = []
    for lib in (fast, portable["permute_cpu"]):
        out, grad_rows, grad_weight = rows.new_empty(T, D), torch.zeros_like(rows), torch.empty(T * K)
        lib.permute_combine(T, K, D, dtype == torch.bfloat16, rows.data_ptr(), row_of.data_ptr(), weight.data_ptr(),
                            out.data_ptr(), 2)
        lib.permute_combine_bwd(T, K, D, dtype == torch.bfloat16, rows.data_ptr(), grad_out.data_ptr(),
                                row_of.data_ptr(), weight.data_ptr(), grad_rows.data_ptr(), grad_weight.data_ptr(), 2)
        results.append((out, grad_rows, grad_weight))
    for got, want in zip(*results):
        assert torch.isfinite(want).any()
        assert same_bits(got, want)
