"""Runs each kernel test file in a fresh pytest process: under TRITON_INTERPRET=1 on CPU always, and on the GPU
(MOE_DIST_KERNEL_DEVICE=cuda) when this machine has one. See conftest.py for why a fresh process."""

import os
import subprocess
import sys
from pathlib import Path

from support import FLA_SITE

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
MODE_ENV = {"interpreter": {"TRITON_INTERPRET": "1"}, "cuda": {"MOE_DIST_KERNEL_DEVICE": "cuda"}}


def test_kernel_file(kernel_test_file, kernel_mode):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MOE_DIST_KERNEL_DEVICE")}
    env.update(MODE_ENV[kernel_mode])
    if kernel_test_file == "test_fla_ops.py" and (FLA_SITE / "fla").is_dir():
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(FLA_SITE), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / kernel_test_file)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=540)
    out = proc.stdout + proc.stderr
    # rc 0 with tests run: pytest exits 5 when nothing was collected, which must not pass silently either.
    assert proc.returncode == 0 and " passed" in out, f"{kernel_test_file} [{kernel_mode}] failed:\n{out[-8000:]}"
