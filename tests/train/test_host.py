"""moe_dist.train.host: subnormal flushing reaches torch's worker threads, and `keep` stops the page faults of
fresh large tensors. Each case runs in a fresh interpreter: both settings are process-wide."""

import json
import subprocess
import sys

import pytest

PROBE = r"""
import json, resource, sys
import torch
from moe_dist.train.host import configure_host

configure_host(2, flush_denormal=sys.argv[1] == "on", malloc=sys.argv[2])
# subnormal bit patterns (made without float arithmetic), through a parallel elementwise op whose chunks run on
# the OpenMP workers too; denormals-are-zero reads them as 0 on every thread that has it
subnormal = torch.full((1 << 22,), 1 << 20, dtype=torch.int32).view(torch.float32)
nonzero = int(torch.count_nonzero(subnormal * 1.0))

def faults_of_a_fresh_64mib_tensor():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = torch.empty(1 << 24)  # 64 MiB fp32: above any glibc mmap threshold
    t.fill_(1.0)
    del t
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

faults = [faults_of_a_fresh_64mib_tensor() for _ in range(4)]
print(json.dumps({"threads": torch.get_num_threads(), "nonzero": nonzero, "faults": faults}))
"""


def probe(flush: str, malloc: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, flush, malloc], capture_output=True, text=True, timeout=120,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_flush_denormal_zeroes_subnormals_on_every_thread():
    on, off = probe("on", "default"), probe("off", "default")
    assert on["threads"] == 2
    assert on["nonzero"] == 0  # every chunk, the workers' included, saw 1e-39 as zero
    assert off["nonzero"] == 1 << 22


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
def test_keep_reuses_freed_memory_instead_of_faulting_it_in_again():
    pages = (1 << 26) // 4096
    keep, default = probe("off", "keep"), probe("off", "default")
    # glibc's default maps every 64 MiB block anew: each one faults in all its pages
    assert all(f >= pages // 2 for f in default["faults"])
    # keep: the first block grows the heap, the ones after it reuse those pages
    assert keep["faults"][0] >= pages // 2 and all(f < pages // 20 for f in keep["faults"][1:])
