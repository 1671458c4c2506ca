"""What the benchmarks share: the interleaved timer, the dense-matmul reference timed in the same rounds as the
thing measured, and the collective tracer (and --device). A standalone matmul peak is the library's
(`moe_dist.train.throughput.measured_peak`, which training's MFU uses too).
"""

from __future__ import annotations

import functools
import inspect
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def resolve_device(name: str) -> torch.device:
    """A benchmark's --device: "auto" takes CUDA when present; "cuda" without it is a ConfigError."""
    from moe_dist.config import ConfigError

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device here")
    return torch.device(name)


# ----------------------------------------------------------------------------------------------- timing


def sync(device: torch.device | str) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously; the CPU needs nothing)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_ms(fns: dict, device: torch.device | str, repeats: int, warmup: int = 2, number: int = 1) -> dict:
    """Median wall time in ms of one call of each of `fns`, synchronized on CUDA before and after each sample.

    The calls are interleaved round by round, so that all of them see the same machine load (other jobs share
    the cores, GPU clocks drift). A sample times `number` consecutive calls and divides: on a GPU that hides the
    synchronization and launch latency under small kernels.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync(device)
            tic = time.perf_counter()
            for _ in range(number):
                fn()
            sync(device)
            times[name].append((time.perf_counter() - tic) * 1e3 / number)
    return {name: statistics.median(ts) for name, ts in times.items()}


def sig(x: float, digits: int = 4) -> float:
    """x to `digits` significant digits, for the reports: a fixed number of decimals would erase a small rate
    (a loaded machine's) or a small fraction."""
    return float(f"{x:.{digits}g}")


# ----------------------------------------------------------------------------------------------- matmul peak


def matmul_fns(shapes: list[tuple[int, int, int]], dtype: torch.dtype, device: torch.device | str) -> dict:
    """torch.mm of (M, K) × (K, N) in `dtype`, one per shape, keyed ("mm", M, K, N): the dense-matmul
    reference, to time in the same rounds as the thing measured (`interleaved_ms`)."""
    fns = {}
    for m, k, n in shapes:
        a = torch.randn(m, k, dtype=dtype, device=device)
        b = torch.randn(k, n, dtype=dtype, device=device)
        fns[("mm", m, k, n)] = lambda a=a, b=b: torch.mm(a, b)
    return fns


def matmul_gflops(ms: dict) -> float:
    """This machine's dense-matmul rate in GFLOP/s: the median over the ("mm", M, K, N) entries of `ms` (times
    from `interleaved_ms` over `matmul_fns`, other entries ignored) of 2·M·K·N / time."""
    rates = [
        2 * m * k * n / t / 1e6
        for key, t in ms.items()
        if isinstance(key, tuple) and key[0] == "mm"
        for m, k, n in [key[1:]]
    ]
    if not rates:
        raise ValueError("no ('mm', M, K, N) timings: time matmul_fns alongside")
    return statistics.median(rates)


# ----------------------------------------------------------------------------------------------- collectives

# torch.distributed function → (kind, the argument whose bytes are its payload, as moe_dist.planning.collectives's
# collective_terms counts it: all-gather the gathered output, all-to-all and reduce-scatter the input, ...)
COLLECTIVES = {
    "all_reduce": ("all_reduce", "tensor"),
    "all_reduce_coalesced": ("all_reduce", "tensors"),
    "all_gather": ("all_gather", "tensor_list"),
    "all_gather_single": ("all_gather", "output_tensor"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "_all_gather_base": ("all_gather", "output_tensor"),
    "reduce_scatter": ("reduce_scatter", "input_list"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "_reduce_scatter_base": ("reduce_scatter", "input"),
    "all_to_all_single": ("all_to_all", "input"),
    "all_to_all": ("all_to_all", "input_tensor_list"),
    "broadcast": ("other", "tensor"),
    "reduce": ("other", "tensor"),
    "barrier": ("other", None),
}


def nbytes(x) -> int:
    """Bytes of a tensor or a (nested) list of tensors; 0 for anything else."""
    if isinstance(x, (list, tuple)):
        return sum(nbytes(t) for t in x)
    return x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0


@dataclass
class Collective:
    """One collective call, as `CollectiveTracer` saw it."""

    name: str  # the torch.distributed function called
    kind: str  # all_reduce | all_gather | reduce_scatter | all_to_all | other
    args: dict  # its arguments, bound to their parameter names
    group_size: int
    payload_bytes: int  # as moe_dist.planning.collectives.collective_terms counts it (COLLECTIVES)
    seconds: float  # wall clock of the call (a blocking one includes the wait for the slowest rank)

    @property
    def contributed_bytes(self) -> int:
        """The bytes this rank puts in: the payload, except an all-gather's, which is every rank's share."""
        return self.payload_bytes // self.group_size if self.kind == "all_gather" else self.payload_bytes


class CollectiveTracer:
    """Wraps torch.distributed's collectives (in `torch.distributed` and `distributed_c10d`, the one seam that
    every caller, our comm.py or DeepSpeed's, goes through) and hands each call to `on_call(Collective)`.

    Only the outermost call is reported (a deprecated name calls its successor, for instance). Install it before
    a library binds the functions to its own names (DeepSpeed does at its initialization).
    """

    def __init__(self, on_call: Callable[[Collective], None]):
        self.on_call = on_call
        self._local = threading.local()
        self._originals: dict[tuple[object, str], Callable] = {}

    def install(self) -> CollectiveTracer:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for name, (kind, arg) in COLLECTIVES.items():
            fn = getattr(c10d, name, None)
            if fn is None:
                continue
            wrapped = self._wrap(fn, name, kind, arg)
            for module in (c10d, dist):
                if getattr(module, name, None) is fn:
                    self._originals[(module, name)] = fn
                    setattr(module, name, wrapped)
        return self

    def uninstall(self) -> None:
        for (module, name), fn in self._originals.items():
            setattr(module, name, fn)
        self._originals.clear()

    def __enter__(self) -> CollectiveTracer:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def _wrap(self, fn: Callable, name: str, kind: str, arg: str | None) -> Callable:
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def traced(*args, **kwargs):
            if getattr(self._local, "inside", False):
                return fn(*args, **kwargs)
            self._local.inside = True
            tic = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds = time.perf_counter() - tic
                self._local.inside = False
                self.on_call(self._describe(name, kind, arg, sig.bind(*args, **kwargs).arguments, seconds))

        return traced

    @staticmethod
    def _describe(name: str, kind: str, arg: str | None, bound: dict, seconds: float) -> Collective:
        import torch.distributed as dist

        group = bound.get("group")
        size = dist.get_world_size(group) if group is not None else dist.get_world_size()
        return Collective(name, kind, bound, size, nbytes(bound.get(arg)) if arg else 0, seconds)
