"""moe_dist.train.host: subnormal flushing reaches torch's worker threads, `keep` stops the page faults of fresh
large tensors, and huge pages back large tensors. Each case runs in a fresh interpreter: the settings are
process-wide."""

import json
import os
import subprocess
import sys

import pytest

PROBE = r"""
import json, resource, sys
import torch
from moe_dist.train.host import configure_host

configure_host(2, flush_denormal=sys.argv[1] == "on", malloc=sys.argv[2], hugepages=sys.argv[3] == "on")

def anon_huge_kib():  # 0 where the kernel has no smaps_rollup (the huge-page test is skipped there)
    try:
        with open("/proc/self/smaps_rollup") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))
    except OSError:
        return 0

# first, a 32 MiB tensor in fresh memory (huge pages back memory faulted in after the request, not reused pages)
huge_before = anon_huge_kib()
big = torch.ones(1 << 23)
huge_kib = anon_huge_kib() - huge_before
del big
# subnormal bit patterns (made without float arithmetic), through a parallel elementwise op whose chunks run on
# the OpenMP workers too; denormals-are-zero reads them as 0 on every thread that has it
subnormal = torch.full((1 << 22,), 1 << 20, dtype=torch.int32).view(torch.float32)
nonzero = int(torch.count_nonzero(subnormal * 1.0))

def faults_of_a_fresh_tensor(numel):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = torch.empty(numel)
    t.fill_(1.0)
    del t
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

def rss_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))

# a 64 MiB block (fp32; above any glibc mmap threshold), freed; then a 40 MiB one, which fits in the freed block
t = torch.empty(1 << 24)
t.fill_(1.0)
before_free = rss_kib()
del t
released_kib = before_free - rss_kib()
faults = faults_of_a_fresh_tensor(10 << 20)
print(json.dumps({"threads": torch.get_num_threads(), "nonzero": nonzero, "released_kib": released_kib,
                  "faults": faults, "huge_kib": huge_kib}))
"""


def probe(flush: str, malloc: str, hugepages: str = "off") -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, flush, malloc, hugepages], capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_flush_denormal_zeroes_subnormals_on_every_thread():
    on, off = probe("on", "default"), probe("off", "default")
    assert on["threads"] == 2
    assert on["nonzero"] == 0  # every chunk, the workers' included, saw 1e-39 as zero
    assert off["nonzero"] == 1 << 22


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
def test_keep_reuses_freed_memory_instead_of_faulting_it_in_again():
    pages = (40 << 20) // 4096  # of the 40 MiB block
    keep, default = probe("off", "keep"), probe("off", "default")
    # glibc's default unmaps a freed large block and maps the next one anew, faulting in all its pages
    assert default["released_kib"] > 60 * 1024 and default["faults"] >= pages // 2
    # keep: the freed block stays in the heap, and the next block reuses its pages
    assert keep["released_kib"] < 1024 and keep["faults"] < pages // 20


def _thp_mode() -> str:
    """The kernel's transparent-huge-page mode: "always", "madvise" or "never" (the bracketed word)."""
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "never"
    return text[text.index("[") + 1:text.index("]")]


@pytest.mark.skipif(_thp_mode() == "never", reason="this kernel has transparent huge pages off")
@pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="no /proc/self/smaps_rollup to read")
def test_hugepages_back_large_tensors_with_huge_pages():
    on, off = probe("off", "keep", "on"), probe("off", "keep", "off")
    assert on["huge_kib"] >= 16 * 1024  # most of the 32 MiB tensor
    if _thp_mode() == "madvise":  # else the kernel gives huge pages to every large mapping anyway
        assert off["huge_kib"] == 0
