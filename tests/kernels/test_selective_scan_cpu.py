"""The compiled CPU selective scan (moe_dist.kernels.selective_scan_cpu): against the sequential reference, outputs
and every gradient, at sizes that cut the kernel's 16-channel blocks; dtypes; threads; the build and its errors.

Tolerance: the kernel computes in fp32, so its error against the fp64 reference may be at most twice the error of
the chunked PyTorch scan run in fp32 on the same inputs, plus a small atol (DESIGN.md §6).
"""

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from moe_dist.kernels import selective_scan_cpu
from moe_dist.kernels.reference import selective_scan_ref
from moe_dist.layers.mamba import select_scan
from moe_dist.layers.scan import selective_scan

NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")


def make_inputs(batch, dim, seqlen, state, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    # Δ > 0 even without the softplus, as in a model: a negative step would make the decay exp(ΔA) grow
    delta = torch.rand(batch, dim, seqlen, generator=g, dtype=torch.float64) * 0.5
    return {"u": rand(batch, dim, seqlen), "delta": delta,
            "A": -torch.exp(rand(dim, state)), "B": rand(batch, state, seqlen), "C": rand(batch, state, seqlen),
            "D": rand(dim), "z": rand(batch, dim, seqlen),
            "delta_bias": torch.rand(dim, generator=g, dtype=torch.float64) * 0.5}


def outputs(fn, inputs, grad_out, dtype, **kw):
    """y and the gradient of every tensor input, computed by `fn` on copies of the inputs in `dtype`."""
    leaves = {k: v.to(dtype).requires_grad_() for k, v in inputs.items() if v is not None}
    y = fn(**leaves, delta_softplus=kw.pop("delta_softplus"), **kw)
    return dict(zip(["y", *leaves], [y, *torch.autograd.grad(y, list(leaves.values()), grad_out.to(y.dtype))]))


def test_kernel_builds_here():
    assert selective_scan_cpu.unavailable() is None  # the dev and CI machines have a C++ compiler


# (batch, dim, seqlen, state): one channel; a block and a tail of 1; tails of 5 and 1 over several blocks; long
@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 17, 7, 5), (2, 37, 100, 16), (1, 33, 300, 3)])
@pytest.mark.parametrize("use_d, use_z, use_bias, softplus", [
    (False, False, False, False), (True, True, True, True), (True, False, True, False), (False, True, False, True),
])
def test_matches_sequential_reference(shape, use_d, use_z, use_bias, softplus):
    inputs = make_inputs(*shape)
    for name, used in (("D", use_d), ("z", use_z), ("delta_bias", use_bias)):
        if not used:
            inputs[name] = None
    grad_out = torch.randn(shape[0], shape[1], shape[2], dtype=torch.float64)
    want = outputs(selective_scan_ref, inputs, grad_out, torch.float64, delta_softplus=softplus)
    chunked = outputs(selective_scan, inputs, grad_out, torch.float32, delta_softplus=softplus, chunk_size=16)
    got = outputs(selective_scan, inputs, grad_out, torch.float32, delta_softplus=softplus, native=True)
    for name, ref in want.items():
        if name not in ("y", "A") or shape[2] > 1:  # A acts only once there is a previous state to decay
            assert ref.abs().sum() > 0, name  # so that a zero gradient cannot pass by matching a zero
        assert got[name].dtype == torch.float32 and got[name].shape == ref.shape, name
        err = (got[name].double() - ref).abs().max().item()
        torch_err = (chunked[name].double() - ref).abs().max().item()
        assert err <= 2 * torch_err + 1e-6 * ref.abs().max().item(), (name, err, torch_err)


def test_low_precision_inputs_compute_in_fp32():
    inputs = make_inputs(2, 20, 9, 4, seed=1)
    grad_out = torch.randn(2, 20, 9, dtype=torch.float64)
    got = outputs(selective_scan, inputs, grad_out, torch.bfloat16, delta_softplus=True, native=True)
    inputs32 = {k: v.bfloat16().float() for k, v in inputs.items()}
    want = outputs(selective_scan, inputs32, grad_out.bfloat16().float(), torch.float32, delta_softplus=True,
                   native=True)
    for name in want:
        assert got[name].dtype == torch.bfloat16, name
        assert torch.equal(got[name], want[name].bfloat16()), name


def test_result_does_not_depend_on_the_thread_count():
    """Each thread sums dB and dC into its own slot: a wrong slot or a race would show against one thread."""
    inputs = make_inputs(3, 40, 50, 6, seed=2)
    grad_out = torch.randn(3, 40, 50, dtype=torch.float64)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            results.append(outputs(selective_scan, inputs, grad_out, torch.float32, delta_softplus=True, native=True))
    finally:
        torch.set_num_threads(threads)
    for name in results[0]:
        torch.testing.assert_close(results[1][name], results[0][name], rtol=1e-5, atol=1e-5, msg=name)


def test_empty_sequence_and_batch():
    for batch, seqlen in ((2, 0), (0, 5)):
        inputs = {k: v.float().requires_grad_() for k, v in make_inputs(batch, 5, seqlen, 3).items()}
        y = selective_scan(**inputs, delta_softplus=True, native=True)
        assert y.shape == (batch, 5, seqlen)
        y.sum().backward()
        assert inputs["A"].grad.abs().sum() == 0 and inputs["A"].grad.shape == (5, 3)


def test_native_refuses_what_it_cannot_compute():
    inputs = make_inputs(1, 4, 3, 2)
    with pytest.raises(ValueError, match=r"native=True\): the fused CPU scan computes in fp32, got torch.float64"):
        selective_scan(**inputs, native=True)
    with pytest.raises(ValueError, match=r"model\.mamba\.impl='cpu': the fused CPU scan takes CPU tensors, got meta"):
        select_scan("cpu", 16)(*(v.to("meta") for v in inputs.values()))


def test_auto_takes_the_kernel_for_fp32_and_the_chunked_scan_for_fp64():
    inputs = make_inputs(2, 19, 30, 4, seed=3)
    auto = select_scan("auto", 16)
    f32 = {k: v.float() for k, v in inputs.items()}
    assert torch.equal(auto(**f32), selective_scan(**f32, native=True))
    assert torch.equal(auto(**inputs), selective_scan(**inputs, chunk_size=16))


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=240, env={**os.environ, **env})


def test_build_is_cached_and_shared_between_processes(tmp_path):
    code = """
        from moe_dist.kernels import cpu_build, selective_scan_cpu as k
        assert k.unavailable() is None
        print(cpu_build.build("selective_scan_cpu"))
    """
    first = run_python(code, MOE_DIST_CACHE=str(tmp_path))
    assert first.returncode == 0, first.stderr
    lib = tmp_path / first.stdout.split("/")[-1].strip()
    built = lib.stat().st_mtime_ns
    second = run_python(code, MOE_DIST_CACHE=str(tmp_path))
    assert second.returncode == 0 and second.stdout == first.stdout, second.stderr
    assert lib.stat().st_mtime_ns == built  # loaded, not compiled again
    assert [p.name for p in tmp_path.iterdir()] == [lib.name]  # no temporary left behind


@pytest.mark.parametrize("cxx, reason", [
    ("/nonexistent/c++", r"no C\+\+ compiler \('/nonexistent/c\+\+' is not on PATH; set CXX\)"),
    ("/bin/false", r"/bin/false failed on selective_scan_cpu\.cpp"),
])
def test_no_compiler_is_a_clear_error_for_cpu_and_a_fallback_for_auto(tmp_path, cxx, reason):
    done = run_python("""
        import warnings, torch
        from moe_dist.layers.mamba import select_scan
        from moe_dist.layers.scan import selective_scan
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            auto = select_scan("auto", 16)
        print("WARNING", caught[0].message)
        u = torch.randn(1, 3, 4)
        args = (u, u.abs(), -torch.ones(3, 2), torch.randn(1, 2, 4), torch.randn(1, 2, 4))
        assert torch.equal(auto(*args), selective_scan(*args, chunk_size=16))
        select_scan("cpu", 16)
    """, MOE_DIST_CACHE=str(tmp_path), CXX=cxx)
    assert done.returncode == 1
    warning = next(ln for ln in done.stdout.splitlines() if ln.startswith("WARNING"))
    assert "model.mamba.impl='auto': the compiled CPU selective scan is not available" in warning
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: model.mamba.impl='cpu': the compiled CPU selective scan is not available "
                           "here: ")
    assert re.search(reason, last), last
    assert not list(tmp_path.iterdir())  # a failed build leaves nothing to load
