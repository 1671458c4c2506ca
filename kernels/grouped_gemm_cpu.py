"""The experts' grouped GEMM on Intel AMX (`grouped_gemm_cpu.cpp`): load, autograd Function, public function.

`grouped_mm(x_RI, w_EIO, rows_per_expert_E)` has the semantics and signature of `moe_dist.layers.moe.grouped_mm`
(torch's `F.grouped_mm` there): rows sorted by expert, row r times its expert's weight. bf16 only, with fp32
accumulation and one rounding per output, as torch's. Each pass is a few kernel calls, each over a run of experts
whose packed operands fit 16 MiB (all 8 experts' rows of a small layer in one or two calls):

    forward  y_g  = x_g · W_g          (W packed: K pairs side by side, what the tile multiply reads)
    grad x   dx_g = dy_g · W_gᵀ        (Wᵀ packed from W's rows directly)
    grad W   dW_g = x_gᵀ · dy_g        (x_g transposed and dy_g packed, each zero-padded to a multiple of 32 rows)

`grouped_mm_gated(x, w13, counts)` is the experts' gate/up GEMM with the gated SiLU in its epilogue: h = silu(gate)
· up of [gate | up] = x · W13, the same bits as `gated_silu_cpu.gated_silu(grouped_mm(x, w13, counts))`.

Built on first use and cached (`cpu_build`); `unavailable()` says why it cannot run here (no AMX-BF16 on this CPU,
no compiler, Linux refused the tile state). Measured on this project's 2-core AMX machine, same process: the bf16
MoE layer (T=4096, D=512) takes 0.69-0.75× the time of the same layer with torch's grouped GEMM at 8 experts,
0.80-0.86× at 64 (launch/bench.py moe reports `speedup_vs_torch_impl`).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from moe_dist.kernels import cpu_build, gated_silu_cpu

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_SIGNATURES = (
    ("grouped_gemm", (_I64, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _INT)),
    ("pack_rows", (_I64, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _INT)),
    ("pack_transposed", (_I64, _I64, _I64, _PTR, _PTR, _INT)),
    ("transpose_rows", (_I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _INT)),
)
ALIGN = 32  # the kernel's block: K, N multiples of it (the weight-gradient K is padded to it)
# packed operands per kernel call: runs of experts up to 16 MiB, so that peak memory does not grow by a packed copy
# of every expert's weight (measured: 2 MiB runs cost 6-16% of the layer time, 8-32 MiB runs within noise of none)
SCRATCH_BYTES = 16 << 20


@functools.lru_cache(maxsize=None)
def cpu_has_amx() -> bool:
    """Whether this CPU has the AMX-BF16 tiles (and the AVX-512 the kernel's packings use)."""
    try:
        flags = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")).split()
    except (OSError, StopIteration):
        return False
    return {"amx_tile", "amx_bf16", "avx512f"} <= set(flags)


@functools.lru_cache(maxsize=None)
def _library() -> tuple[Optional[ctypes.CDLL], Optional[str]]:
    if not cpu_has_amx():
        return None, "this CPU has no AMX-BF16 (amx_tile, amx_bf16 and avx512f in /proc/cpuinfo)"
    lib, why = cpu_build.library("grouped_gemm_cpu", _SIGNATURES)
    if lib is None:
        return None, why
    lib.amx_request.restype = ctypes.c_int
    if lib.amx_request() != 0:
        return None, "Linux refused this process the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"
    return lib, None


def unavailable() -> Optional[str]:
    """Why the kernel cannot run in this process, or None; builds it on first call."""
    return _library()[1]


def _call(fn, *args) -> None:
    """fn(*args) with tensors passed as their data pointers and lists of ints as int64 arrays (kept alive for the
    call), then torch's thread count."""
    keep = [torch.as_tensor(a, dtype=torch.int64) if isinstance(a, list) else a for a in args]
    fn(*(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in keep), torch.get_num_threads())


def _gemm(lib, M: list, K: list, N: int, a, a_off: list, lda: list, b, b_off: list, c, c_off: list, ldc: int,
          h=None, h_off: Optional[list] = None):
    """Every group g: c[c_off_g:] (M_g, N) = a[a_off_g:] (M_g, K_g; row stride lda_g) · packed b[b_off_g:]; with `h`
    (the gated mode, N = 2F), also h[h_off_g:] (M_g, F) = silu(c's first half) · c's second half, rounded once."""
    assert c.data_ptr() % 64 == 0 and (h is None or h.data_ptr() % 64 == 0), "the kernel streams whole 64-byte lines"
    _call(lib.grouped_gemm, len(M), M, K, N, a, a_off, lda, b, b_off, c, c_off, ldc, h, h_off, N // 2)


def _chunks(nbytes: list) -> list:
    """Runs [e0, e1) of consecutive experts whose packed operands (`nbytes` each) fit in SCRATCH_BYTES together (one
    expert at least)."""
    runs, e0, total = [], 0, 0
    for e, n in enumerate(nbytes):
        if e > e0 and total + n > SCRATCH_BYTES:
            runs.append((e0, e))
            e0, total = e, 0
        total += n
    return runs + [(e0, len(nbytes))] if nbytes else runs


def _weight_gemm(lib, a_RK: torch.Tensor, w_EIO: torch.Tensor, counts: list, starts: list,
                 transposed: bool, h_RF: Optional[torch.Tensor] = None) -> torch.Tensor:
    """c_g = a_g · W_g (transposed=False: a is (R, I), c (R, O)) or a_g · W_gᵀ (True: a (R, O), c (R, I)), over runs
    of experts whose packed weights fit one SCRATCH_BYTES buffer, reused run after run: no pass holds a packed copy
    of every expert's weight. `h_RF` (not transposed): also the gated SiLU of c = [gate | up] into it."""
    E, I, O = w_EIO.shape
    K, N = (O, I) if transposed else (I, O)
    c_RN = a_RK.new_empty(a_RK.shape[0], N)
    runs = _chunks([2 * I * O] * E)
    scratch = a_RK.new_empty(max(e1 - e0 for e0, e1 in runs) * I * O)
    for e0, e1 in runs:
        n = e1 - e0
        if transposed:  # W_gᵀ (O, I) as the B operand
            _call(lib.pack_transposed, n, I, O, w_EIO[e0:e1], scratch)
        else:  # W_g (I, O) as the B operand
            _call(lib.pack_rows, n, [j * I for j in range(n)], [I] * n, [I] * n, O, w_EIO[e0:e1], O, scratch,
                  [j * I * O for j in range(n)])
        h_off = None if h_RF is None else [s * (N // 2) for s in starts[e0:e1]]
        _gemm(lib, counts[e0:e1], [K] * n, N, a_RK, [s * K for s in starts[e0:e1]], [K] * n, scratch,
              [j * I * O for j in range(n)], c_RN, [s * N for s in starts[e0:e1]], N, h_RF, h_off)
    return c_RN


def _rows(rows_per_expert_E: torch.Tensor) -> tuple[list, list]:
    """(rows of each expert, first row of each expert) as Python ints."""
    counts = [int(n) for n in rows_per_expert_E.tolist()]
    return counts, [sum(counts[:e]) for e in range(len(counts))]


def _grads(lib, ctx, x_RI: torch.Tensor, w_EIO: torch.Tensor, dy_RO: torch.Tensor) -> tuple:
    """(dx, dW) of y = x · W per expert, each only if asked for (ctx.needs_input_grad)."""
    dw = _grad_weight(lib, x_RI, dy_RO, w_EIO.shape, ctx.counts, ctx.starts) if ctx.needs_input_grad[1] else None
    dx = _weight_gemm(lib, dy_RO, w_EIO, ctx.counts, ctx.starts, transposed=True) if ctx.needs_input_grad[0] else None
    return dx, dw


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RI: torch.Tensor, w_EIO: torch.Tensor, rows_per_expert_E: torch.Tensor) -> torch.Tensor:
        lib, why = _library()
        assert lib is not None, why
        ctx.counts, ctx.starts = _rows(rows_per_expert_E)
        ctx.save_for_backward(x_RI, w_EIO)
        return _weight_gemm(lib, x_RI, w_EIO, ctx.counts, ctx.starts, transposed=False)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy_RO: torch.Tensor):
        x_RI, w_EIO = ctx.saved_tensors
        return *_grads(_library()[0], ctx, x_RI, w_EIO, dy_RO.to(torch.bfloat16).contiguous()), None


class _GroupedGatedMM(torch.autograd.Function):
    """h = silu(gate) · up of [gate | up] = x · W13 per expert, the gated SiLU in the GEMM's epilogue; keeps x and
    [gate | up] (bf16), as the unfused GEMM and SiLU do. Backward: the gated SiLU's backward kernel, then the GEMM's."""

    @staticmethod
    def forward(ctx, x_RD: torch.Tensor, w13_ED2F: torch.Tensor, rows_per_expert_E: torch.Tensor) -> torch.Tensor:
        lib, why = _library()
        assert lib is not None, why
        ctx.counts, ctx.starts = _rows(rows_per_expert_E)
        h_RF = x_RD.new_empty(x_RD.shape[0], w13_ED2F.shape[2] // 2)
        # [gate | up] is this Function's own tensor (no one else can modify it): held as an attribute, so that the
        # backward can drop it before the GEMMs, as the unfused SiLU's backward does (else peak memory grows by it)
        ctx.ab_R2F = _weight_gemm(lib, x_RD, w13_ED2F, ctx.counts, ctx.starts, transposed=False, h_RF=h_RF)
        ctx.save_for_backward(x_RD, w13_ED2F)
        return h_RF

    @staticmethod
    @once_differentiable
    def backward(ctx, dh_RF: torch.Tensor):
        x_RD, w13_ED2F = ctx.saved_tensors
        if ctx.ab_R2F is None:
            raise RuntimeError("grouped_mm_gated: a second backward through the same graph (retain_graph=True) is not "
                               "supported: the first one freed its [gate | up]")
        dab_R2F = gated_silu_cpu.gated_silu_backward(ctx.ab_R2F, dh_RF)
        ctx.ab_R2F = None
        return *_grads(_library()[0], ctx, x_RD, w13_ED2F, dab_R2F), None


def _grad_weight(lib, x_RI: torch.Tensor, dy_RO: torch.Tensor, shape, counts: list, starts: list) -> torch.Tensor:
    """dW_g = x_gᵀ · dy_g over each expert's rows, zero-padded to a multiple of 32. (E, I, O)"""
    E, I, O = shape
    padded = [-(-n // ALIGN) * ALIGN for n in counts]
    dw_EIO = x_RI.new_empty(E, I, O)
    runs = _chunks([2 * (I + O) * p for p in padded])
    longest = max(sum(padded[e0:e1]) for e0, e1 in runs)
    x_t, dy_p = x_RI.new_empty(I * longest), x_RI.new_empty(O * longest)  # x_gᵀ (I, padded_g); dy_g packed as B
    for e0, e1 in runs:
        n, pads = e1 - e0, padded[e0:e1]
        offs = [sum(pads[:j]) for j in range(n)]
        _call(lib.transpose_rows, n, starts[e0:e1], counts[e0:e1], pads, I, x_RI, x_t, [o * I for o in offs])
        _call(lib.pack_rows, n, starts[e0:e1], counts[e0:e1], pads, O, dy_RO, O, dy_p, [o * O for o in offs])
        _gemm(lib, [I] * n, pads, O, x_t, [o * I for o in offs], pads, dy_p, [o * O for o in offs], dw_EIO,
              [e * I * O for e in range(e0, e1)], O)
    return dw_EIO


def grouped_mm_unsupported(x_RI: torch.Tensor, w_EIO: torch.Tensor, rows_per_expert_E: torch.Tensor) -> Optional[str]:
    """Why the kernel cannot take these tensors, or None."""
    if x_RI.device.type != "cpu" or w_EIO.device.type != "cpu":
        return f"the AMX grouped GEMM takes CPU tensors, got {x_RI.device} and {w_EIO.device}"
    if x_RI.dtype != torch.bfloat16 or w_EIO.dtype != torch.bfloat16:
        return f"the AMX grouped GEMM takes bf16 rows and weights, got {x_RI.dtype} and {w_EIO.dtype}"
    if w_EIO.dim() != 3 or x_RI.dim() != 2 or x_RI.shape[1] != w_EIO.shape[1]:
        return f"the AMX grouped GEMM needs (R, I) rows and (E, I, O) weights, got {tuple(x_RI.shape)} and " \
               f"{tuple(w_EIO.shape)}"
    if w_EIO.shape[1] % ALIGN or w_EIO.shape[2] % ALIGN:
        return f"the AMX grouped GEMM needs both weight dims to be multiples of {ALIGN}, got {tuple(w_EIO.shape[1:])}"
    return None


def _check_counts(name: str, x_RI: torch.Tensor, w_EIO: torch.Tensor, rows_per_expert_E: torch.Tensor) -> None:
    if int(rows_per_expert_E.sum()) != x_RI.shape[0] or rows_per_expert_E.shape != (w_EIO.shape[0],):
        raise ValueError(f"{name}: rows_per_expert_E must have {w_EIO.shape[0]} counts summing to "
                         f"{x_RI.shape[0]} rows, got {rows_per_expert_E.tolist()}")


def grouped_mm(x_RI: torch.Tensor, w_EIO: torch.Tensor, rows_per_expert_E: torch.Tensor) -> torch.Tensor:
    """(R, I) bf16 rows sorted by expert × (E, I, O) bf16 weights → (R, O) bf16: row r times its expert's weight."""
    reason = grouped_mm_unsupported(x_RI, w_EIO, rows_per_expert_E) or unavailable()
    if reason is not None:
        raise ValueError(f"grouped_mm: {reason}")
    _check_counts("grouped_mm", x_RI, w_EIO, rows_per_expert_E)
    return _GroupedMM.apply(x_RI.contiguous(), w_EIO.contiguous(), rows_per_expert_E)


def grouped_mm_gated_unsupported(x_RD: torch.Tensor, w13_ED2F: torch.Tensor,
                                 rows_per_expert_E: torch.Tensor) -> Optional[str]:
    """Why the fused gate/up GEMM cannot take these tensors, or None."""
    reason = grouped_mm_unsupported(x_RD, w13_ED2F, rows_per_expert_E)
    if reason is None and w13_ED2F.shape[2] % (2 * ALIGN):
        return f"the fused gate/up GEMM needs F = {w13_ED2F.shape[2] // 2} to be a multiple of {ALIGN}"
    return reason or gated_silu_cpu.unavailable()


def grouped_mm_gated(x_RD: torch.Tensor, w13_ED2F: torch.Tensor, rows_per_expert_E: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up of the experts' fused projection [gate | up] = x · W13: (R, D) bf16 rows sorted by expert ×
    (E, D, 2F) bf16 → (R, F) bf16. The same bits as `gated_silu_cpu.gated_silu(grouped_mm(x, w13, counts))`, the SiLU
    computed in the GEMM's epilogue while the tile unit multiplies (no pass of its own over [gate | up])."""
    reason = grouped_mm_gated_unsupported(x_RD, w13_ED2F, rows_per_expert_E) or unavailable()
    if reason is not None:
        raise ValueError(f"grouped_mm_gated: {reason}")
    _check_counts("grouped_mm_gated", x_RD, w13_ED2F, rows_per_expert_E)
    return _GroupedGatedMM.apply(x_RD.contiguous(), w13_ED2F.contiguous(), rows_per_expert_E)
