"""Build and load the compiled CPU kernels (`<name>.cpp` beside this file, plain C ABI) with ctypes.

Each kernel is compiled on first use with the host's C++ compiler (`$CXX`, else `c++`) for this CPU
(-march=native) and cached under `$MOE_DIST_CACHE` (default `~/.cache/moe_dist`), keyed by its source, the shared
headers, the compiler, the flags and the CPU, so later processes load it in milliseconds. Not
torch.utils.cpp_extension: the kernels need no torch headers, whose compile alone takes tens of seconds per cache
miss on a 2-core machine, and no ninja. They run on torch's own OpenMP runtime (the same libgomp.so.1, already
loaded by torch) with the thread count the caller passes (torch's).
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

HERE = Path(__file__).resolve().parent
FLAGS = ("-O3", "-march=native", "-std=c++17", "-fopenmp", "-fPIC", "-shared")


@functools.lru_cache(maxsize=None)
def _cpu_id() -> str:
    """The CPU model and feature flags: -march=native code built on one CPU may not run on another."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))


def cache_dir() -> Path:
    return Path(os.environ.get("MOE_DIST_CACHE") or Path.home() / ".cache" / "moe_dist")


@functools.lru_cache(maxsize=None)
def _compiler(cxx: str) -> tuple[str, str]:
    """(path, `--version` output) of the compiler `cxx`, asked once per process for all kernels."""
    compiler = shutil.which(cxx)
    if compiler is None:
        raise RuntimeError(f"no C++ compiler ({cxx!r} is not on PATH; set CXX)")
    try:
        return compiler, subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise RuntimeError(f"{compiler} --version failed: {err}") from None


def build(name: str) -> Path:
    """Compile kernel `name` (or find it compiled) and return the library's path; RuntimeError with the reason."""
    source = HERE / f"{name}.cpp"
    compiler, version = _compiler(os.environ.get("CXX", "c++"))
    headers = [h.read_text() for h in sorted(HERE.glob("*.h"))]
    key = hashlib.sha256("\0".join([source.read_text(), *headers, compiler, version, *FLAGS, _cpu_id()]).encode())
    lib = cache_dir() / f"{name}-{key.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    # compile to a private name, then rename: concurrent ranks never load a half-written library
    fd, tmp = tempfile.mkstemp(dir=lib.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, f"-I{HERE}", str(source), "-o", tmp], capture_output=True, text=True,
                              timeout=300)
        if done.returncode != 0:
            first = next((ln for ln in done.stderr.splitlines() if "error" in ln), done.stderr.strip()[:200])
            raise RuntimeError(f"{compiler} failed on {source.name}: {first}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


@functools.lru_cache(maxsize=None)
def library(name: str, signatures: tuple) -> tuple[Optional[ctypes.CDLL], Optional[str]]:
    """(kernel `name` loaded, None) or (None, why not), once per process. `signatures`: ((function, argtypes), ...),
    or (function, argtypes, restype) for a function that returns a value."""
    try:
        lib = ctypes.CDLL(str(build(name)))
    except (RuntimeError, OSError) as err:
        return None, str(err)
    for fn, argtypes, *restype in signatures:
        getattr(lib, fn).argtypes, getattr(lib, fn).restype = list(argtypes), (restype or [None])[0]
    return lib, None
