"""How the Triton kernel tests run, and the tolerance rule they share.

The kernel test files (test_flash_attention.py, test_fla_ops.py, test_selective_scan.py, test_permute.py) run
in one of two modes:
- interpreter: TRITON_INTERPRET=1 on CPU tensors. Triton reads the variable when a kernel is decorated, i.e. when
  its module is first imported, so it must be set before the process imports any kernel module: a plain
  `python -m pytest` runs these files in fresh subprocesses (test_kernel_suites.py) instead of collecting them.
- cuda: MOE_DIST_KERNEL_DEVICE=cuda, on a GPU machine (benchmarks/gpu_check/, or test_kernel_suites.py when
  CUDA is present); the same tests plus a few realistic sizes run on the GPU.
In a plain run this directory collects only test_kernel_choice.py (the "auto"/"torch"/"triton" choice) and the runner.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from support import FLA_SITE

from moe_dist.layers.kernel_choice import triton_interpreting

HERE = Path(__file__).resolve().parent
KERNEL_TEST_FILES = ("test_flash_attention.py", "test_fla_ops.py", "test_permute.py", "test_selective_scan.py")
RUNNER, IMPL_TESTS = "test_kernel_suites.py", "test_kernel_choice.py"

if os.environ.get("MOE_DIST_KERNEL_DEVICE") == "cuda":
    MODE = "cuda"
    collect_ignore = [RUNNER]
elif triton_interpreting():
    MODE = "interpreter"
    collect_ignore = [RUNNER, IMPL_TESTS]  # the plain run covers the implementation choice
else:
    MODE = "plain"
    collect_ignore = list(KERNEL_TEST_FILES)


def _interpreter_bf16_dots() -> None:
    """Triton's interpreter stores bf16 as uint16 and its `tl.dot` multiplies those bit patterns (triton-lang/
    triton#11584; maintainers: bf16 is not supported in the interpreter). Give the dot fp32 operands instead, as
    the GPU's bf16 tensor cores effectively do (exact products, fp32 accumulation), so bf16 attention is testable
    on CPU. Test-only: the kernels themselves are unchanged."""
    import triton.language as tl
    from triton.runtime import interpreter

    create_dot = interpreter.InterpreterBuilder.create_dot

    def create_dot_bf16_as_fp32(self, a, b, d, *args):
        def widen(h):
            return self.cast_impl(h, tl.float32) if h.dtype.scalar == tl.bfloat16 else h

        return create_dot(self, widen(a), widen(b), d, *args)

    interpreter.InterpreterBuilder.create_dot = create_dot_bf16_as_fp32


if MODE == "interpreter":
    _interpreter_bf16_dots()
elif MODE == "cuda" and not torch.cuda.is_available():
    raise pytest.UsageError("MOE_DIST_KERNEL_DEVICE=cuda but torch sees no CUDA device")


def pytest_collection_modifyitems(config, items):
    if MODE == "plain":
        wrong = sorted(
            {item.path.name for item in items if item.path.parent == HERE and item.path.name in KERNEL_TEST_FILES}
        )
        if wrong:
            raise pytest.UsageError(
                f"{', '.join(wrong)}: run with TRITON_INTERPRET=1 (CPU) or "
                f"MOE_DIST_KERNEL_DEVICE=cuda; a plain run executes them through {RUNNER}"
            )


def pytest_generate_tests(metafunc):
    """The runner's parameters: every kernel test file in every mode this machine offers."""
    if "kernel_test_file" in metafunc.fixturenames:
        modes = ["interpreter"] + (["cuda"] if torch.cuda.is_available() else [])
        no_fla = pytest.mark.skip(reason="fla-core (the optional extra `fla`) is not installed, nor in .fla/")
        has_fla = importlib.util.find_spec("fla") is not None or (FLA_SITE / "fla").is_dir()
        files = [
            pytest.param(f, marks=no_fla) if f == "test_fla_ops.py" and not has_fla else f for f in KERNEL_TEST_FILES
        ]
        metafunc.parametrize("kernel_test_file", files)
        metafunc.parametrize("kernel_mode", modes)


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if MODE == "cuda" else "cpu")


def assert_within_torch_error(name: str, got: torch.Tensor, torch_got: torch.Tensor, ref: torch.Tensor) -> None:
    """The kernel's error against a high-precision reference (max-abs) must be at most twice PyTorch's own error
    in the same dtype, plus a small atol relative to the reference's largest magnitude: one rounding step of the
    dtype (machine epsilon), and at least 1e-5, the fp32 noise of summing in another order (torch.testing's fp32
    atol), since every kernel computes in fp32 and PyTorch's fp32 error can be a single ulp."""
    assert got.shape == ref.shape and got.dtype == torch_got.dtype, (name, got.shape, ref.shape, got.dtype)
    if ref.numel() == 0:
        return
    ref = ref.double().cpu()
    err = (got.double().cpu() - ref).abs().max().item()
    base = (torch_got.double().cpu() - ref).abs().max().item()
    scale = ref.abs().max().item() or 1.0  # an all-zero reference (dq of a single key) is judged at scale 1
    atol = max(torch.finfo(got.dtype).eps, 1e-5) * scale
    assert err <= 2 * base + atol, f"{name}: kernel error {err:.3g} > 2 × PyTorch error {base:.3g} + {atol:.3g}"


@pytest.fixture
def within_torch_error():
    return assert_within_torch_error
