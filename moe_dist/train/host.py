"""Process-wide CPU settings of a training (or benchmark) process: threads, subnormal flushing, allocator policy,
huge pages.

The settings below were found by profiling the MoE layer on CPU (issue 7):

- Subnormal floats. A saturated router (large logits) gives softmax gradients around 1e-39; x86 cores take a
  microcode assist on every subnormal operand, which made the router's fp32 backward GEMMs 150× slower
  (183 ms instead of 1.2 ms for a (4096, 64) × (64, 512) product). Flush-to-zero/denormals-are-zero turns them
  into zeros, as TensorFlow does on CPU by default; values below 1.2e-38 do not move a training run. The MXCSR
  register is per thread and a new thread inherits its creator's, so this must run before torch starts its
  OpenMP pool (the first parallel op), or the pool's workers keep computing with subnormals.
- Freed memory. glibc serves every block above its mmap threshold (at most 32 MiB, whatever is asked) with a
  fresh mmap and unmaps it on free, so every large tensor page-faults on first touch (12,289 faults and 2.5×
  the time of the arithmetic for a (24576, 512) fp32 product). `M_MMAP_MAX = 0` makes glibc take every block
  from its heap, and a high trim threshold keeps freed heap for reuse: the process keeps its peak footprint, as
  a caching allocator does. Limit: glibc 2.36's aligned allocation asks for a little slack beyond the block, so
  a freed block is not always reused for the next block of the very same size; the heap grows until the workload
  finds free blocks that fit (the E=64 MoE bench: 105,000 faults in its first pass, a few thousand in the next
  ones, none from the 8th on).
- Huge pages. With 4 KiB pages, kernels that read routed rows in token order (the MoE combine and its backward:
  1 KiB rows scattered over 25 MB at E=64) miss the TLB on most rows, and in a virtual machine each miss is a
  two-level page walk. PyTorch's `THP_MEM_ALLOC_ENABLE=1` asks for transparent huge pages (madvise) on CPU blocks
  of 2 MiB and more; it is read at the process's first tensor allocation, so it is set here, before any. Memory
  that glibc hands out again keeps the pages it was first faulted in with, so this is for the start of a process.
  Measured on the 2-core AMX VM in one process, on buffers mapped with and without MADV_HUGEPAGE: the bf16
  combine 0.79-0.81× the time, its backward 0.85-0.87×; the AMX GEMM and the gather 0.98-1.01× (no change). No
  effect where the kernel's THP setting is "never"; it applies to child processes too (the launchers' workers).
"""

from __future__ import annotations

import ctypes
import os
import sys

import torch

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # mallopt parameters (glibc malloc.h)


def keep_freed_memory() -> bool:
    """Serve all tensors from glibc's heap and never return freed memory to the OS; False where not glibc."""
    if sys.platform != "linux":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    # mallopt takes a C int: the largest trim threshold is 2 GiB of free heap top (a larger Python int wraps)
    return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def configure_host(threads: int = 0, flush_denormal: bool = True, malloc: str = "keep", hugepages: bool = True) -> None:
    """Apply the settings above; call it first, before any torch op has run (see the notes on subnormals and huge
    pages)."""
    os.environ["THP_MEM_ALLOC_ENABLE"] = "1" if hugepages else "0"
    if flush_denormal:
        torch.set_flush_denormal(True)  # False (and no effect) on CPUs without FTZ/DAZ
    if malloc == "keep":
        keep_freed_memory()
    if threads:
        torch.set_num_threads(threads)
