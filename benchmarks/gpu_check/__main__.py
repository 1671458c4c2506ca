"""`python -m benchmarks.gpu_check`: the GPU check (benchmarks/gpu_check/__init__.py says what it proves)."""

import sys

from benchmarks.gpu_check import STARTED, main

sys.exit(main(started=STARTED))
