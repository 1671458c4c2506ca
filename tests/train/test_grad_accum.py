"""Numerics at many micro-batches (bf16 weights, ZeRO 2 and ZeRO 1's one reduction per step) and the optimizer
state after a resume from a checkpoint saved before any applied step; one real process (grad_accum_worker.py)
serves both."""

import json
from pathlib import Path

import pytest
from support import worker_env

WORKER = Path(__file__).with_name("grad_accum_worker.py")
REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def result(tmp_path_factory, forks):
    out = tmp_path_factory.mktemp("accum")
    proc = forks.run(1, [str(out)], worker_env(), None, 500, script=WORKER, cwd=REPO)  # `python WORKER OUT`, forked
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "rank0.json").read_text())


def test_fp32_accumulation_of_16_bf16_micro_batches_is_exact_where_bf16_is_not(result):
    """Against the exact (fp64) sum of the same 16 bf16 micro-batch gradients: fp32 accumulation (the default)
    leaves only fp32 rounding; bf16 accumulation (train.grad_accum_dtype=bf16) loses ~1e-3 of the gradient."""
    fp32, bf16 = result["fp32"]["rel_error"], result["bf16"]["rel_error"]
    print(f"\nrelative gradient error after 16 micro-batches: fp32 accumulation {fp32:.2e}, bf16 {bf16:.2e}")
    assert result["fp32"]["param_dtype"] == "torch.bfloat16"
    assert fp32 < 1e-6
    assert bf16 > 1e-4 and bf16 > 100 * fp32


@pytest.mark.parametrize("key", ["fp32_zero1", "fp32_zero1_overlap"])
def test_zero1_accumulates_in_fp32_in_deepspeeds_zero_optimizer(result, key):
    """ZeRO 1 with bf16 weights: the same fp32 accumulation, in the optimizer class whose state checkpoints read
    (DeepSpeed alone would choose BF16_Optimizer); also with the reduction issued from the last micro-batch's
    gradient hooks over several buckets (DeepSpeed's own overlap reduced micro-batch 1's gradient alone there)."""
    zero1 = result[key]
    assert zero1["optimizer"] == "DeepSpeedZeroOptimizer" and zero1["param_dtype"] == "torch.bfloat16"
    assert zero1["rel_error"] < 1e-6


@pytest.mark.parametrize("key", ["resume", "resume_zero1"])
def test_resume_from_a_checkpoint_before_any_step_puts_adam_state_where_adam_keeps_it(result, key):
    r = result[key]
    assert r["step"] == 0 and r["loaded"]
    for group in r["loaded"]:
        dtype, device = group["param"]
        assert group["step"] == ["torch.float32", device, 0.0]  # fused AdamW: fp32 step on the parameter's device
        for moment in ("exp_avg", "exp_avg_sq"):
            assert group[moment] == [dtype, device, True]
    assert r["applied"] and r["steps_after"] == [1.0] * len(r["loaded"])
