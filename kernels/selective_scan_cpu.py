"""The selective scan's fused CPU kernel (`selective_scan_cpu.cpp`): build, load, autograd Function, public function.

The kernel is C++ with a plain C ABI, compiled on first use with the host's C++ compiler (`$CXX`, else `c++`) for
this CPU (-march=native) and loaded with ctypes; the library is cached under `$MOE_DIST_CACHE` (default
`~/.cache/moe_dist`), keyed by source, compiler, flags and CPU, so later processes load it in milliseconds.
Not torch.utils.cpp_extension: the kernel needs no torch headers, whose compile alone takes tens of seconds per
cache miss on a 2-core machine, and no ninja. It runs on torch's own OpenMP runtime (the same libgomp.so.1) with
torch's thread count.

`selective_scan_time_major` is what `moe_dist.layers.scan.selective_scan(..., native=True)` calls in place of the
chunked PyTorch scan; `unavailable()` says why it cannot be built here (None when it can).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

SOURCE = Path(__file__).with_suffix(".cpp")
FLAGS = ("-O3", "-march=native", "-std=c++17", "-fopenmp", "-fPIC", "-shared")
LANES = 16  # the kernel's channels per vector (W in the source): its dB/dC accumulators are lane-wise

_ARGS = [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 8 + [ctypes.c_int]
_BWD_ARGS = [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 15 + [ctypes.c_int]


def _cpu_id() -> str:
    """The CPU model and feature flags: -march=native code built on one CPU may not run on another."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))


def _cache_dir() -> Path:
    return Path(os.environ.get("MOE_DIST_CACHE") or Path.home() / ".cache" / "moe_dist")


def _build() -> Path:
    """Compile the kernel (or find it compiled) and return the library's path; RuntimeError with the reason."""
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX', 'c++')!r} is not on PATH; set CXX)")
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise RuntimeError(f"{compiler} --version failed: {err}") from None
    key = hashlib.sha256("\0".join([SOURCE.read_text(), compiler, version, *FLAGS, _cpu_id()]).encode()).hexdigest()
    lib = _cache_dir() / f"selective_scan_cpu-{key[:16]}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    # compile to a private name, then rename: concurrent ranks never load a half-written library
    fd, tmp = tempfile.mkstemp(dir=lib.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            first = next((ln for ln in done.stderr.splitlines() if "error" in ln), done.stderr.strip()[:200])
            raise RuntimeError(f"{compiler} failed on {SOURCE.name}: {first}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


@functools.lru_cache(maxsize=None)
def _library() -> tuple[Optional[ctypes.CDLL], Optional[str]]:
    """(the loaded kernel library, None) or (None, why not), once per process."""
    try:
        lib = ctypes.CDLL(str(_build()))
    except (RuntimeError, OSError) as err:
        return None, str(err)
    lib.scan_fwd.argtypes, lib.scan_fwd.restype = _ARGS, None
    lib.scan_bwd.argtypes, lib.scan_bwd.restype = _BWD_ARGS, None
    return lib, None


def unavailable() -> Optional[str]:
    """Why the kernel cannot run in this process (no compiler, a failed build), or None; builds it on first call."""
    return _library()[1]


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


class _NativeScan(torch.autograd.Function):
    """y = (scan(u, Δ, A, B, C) + D u) · silu(z) on time-major fp32 inputs; the backward runs the kernel's adjoint."""

    @staticmethod
    def forward(ctx, u, delta, A, B, C, D, z):
        lib, why = _library()
        assert lib is not None, why
        (batch, length, dim), state = u.shape, A.shape[1]
        A_t = A.t().contiguous()  # (N, D): the kernel loads A's row n for 16 channels at once
        y = torch.empty_like(u)
        lib.scan_fwd(batch, length, dim, state, *map(_ptr, (u, delta, A_t, B, C, D, z, y)), torch.get_num_threads())
        ctx.save_for_backward(u, delta, A_t, B, C, D, z)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        lib, _ = _library()
        u, delta, A_t, B, C, D, z = ctx.saved_tensors
        (batch, length, dim), state, threads = u.shape, A_t.shape[0], torch.get_num_threads()
        dy = dy.contiguous()
        d_u, d_delta = torch.empty_like(u), torch.empty_like(delta)
        dz = None if z is None else torch.empty_like(z)
        dA_part, dD_part = u.new_empty(batch, state, dim), u.new_empty(batch, dim)
        dB_part, dC_part = (u.new_zeros(threads, batch, length, state, LANES) for _ in range(2))
        assert dB_part.data_ptr() % 64 == 0 and dC_part.data_ptr() % 64 == 0  # the kernel adds whole vectors
        lib.scan_bwd(batch, length, dim, state, *map(_ptr, (u, delta, A_t, B, C, D, z, dy, d_u, d_delta, dz, dA_part,
                                                           dD_part, dB_part, dC_part)), threads)
        dD = None if D is None else dD_part.sum(0)
        return d_u, d_delta, dA_part.sum(0).t(), dB_part.sum((0, 4)), dC_part.sum((0, 4)), dD, dz


def selective_scan_time_major(u, delta, A, B, C, D=None, z=None) -> torch.Tensor:
    """The fused scan, y_t = (<h_t, C_t> + D u_t) · silu(z_t), differentiable in every argument.

    Shapes: u, delta, z (batch, len, dim); A (dim, state); B, C (batch, len, state); D (dim,). D and z may be None.
    All fp32 CPU tensors, contiguous (Δ already biased and softplus-ed). Returns y (batch, len, dim), fp32.
    """
    for name, t in zip("u delta A B C D z".split(), (u, delta, A, B, C, D, z)):
        if t is not None and (t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous()):
            raise ValueError(f"selective_scan_time_major: {name} must be a contiguous fp32 CPU tensor, "
                             f"got {t.dtype} on {t.device}{'' if t.is_contiguous() else ', not contiguous'}")
    return _NativeScan.apply(u, delta, A, B, C, D, z)
