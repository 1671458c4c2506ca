#!/usr/bin/env bash
# Everything worth checking on a lent GPU, in one run sized for a few minutes of device time:
#   1. the kernel tests on CUDA (launch/gpu_check.py --tests-only), in the background;
#   2. training on the GPU: the same 30 steps with the Triton kernels ("auto") and with the PyTorch paths
#      ("torch"), per-step losses compared; then the default job in bf16;
#   3. benchmarks, alone on the GPU: gpu_check.py's kernel benchmarks and launch/bench.py (moe, scan, step).
# Logs go to runs/gpu_session (and, where $OUT is set, one archive of them and the runs' metrics to
# $OUT/gpu_session.tgz). Usage, from the repository root:  bash launch/gpu_session.sh
# A shorter rerun: KERNEL_TESTS="tests/kernels/test_permute.py ..." SKIP_BENCH=1 bash launch/gpu_session.sh
# Where packages are missing (a machine with torch and triton but no DeepSpeed), put wheels in .gpu/whl and
# a tarball of an installed deepspeed package in .gpu/deepspeed.tgz: they are unpacked into /tmp/site. Built
# here for a Python 3.12 GPU image (list .gpu/ in .git/info/exclude and carry it):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .gpu/whl pydantic pydantic_core hjson annotated_types typing_inspection
#   tar czf .gpu/deepspeed.tgz -C "$(python -c 'import deepspeed, os; print(os.path.dirname(deepspeed.__path__[0]))')" \
#     deepspeed deepspeed-*.dist-info
# (pin the versions this machine has: `pip show pydantic pydantic_core`; pydantic_core must match pydantic.)
set -u
LOGS=runs/gpu_session
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if [ -d .gpu/whl ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl
  [ -f .gpu/deepspeed.tgz ] && tar xzf .gpu/deepspeed.tgz -C /tmp/site
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
$PY -m pip install -q --no-deps --no-build-isolation -e . > "$LOGS/install.log" 2>&1 || cat "$LOGS/install.log"
{ nvidia-smi -L; $PY -c "import torch, triton, deepspeed; print('torch', torch.__version__, 'triton', triton.__version__,
'deepspeed', deepspeed.__version__, torch.cuda.get_device_name())"; } > "$LOGS/env.txt" 2>&1
cat "$LOGS/env.txt"
stamp() { echo "[$(date +%T)] $*"; }

stamp "kernel tests on CUDA (background)"
if [ -n "${KERNEL_TESTS:-}" ]; then  # a rerun: only these pytest node ids / files
  MOE_DIST_KERNEL_DEVICE=cuda $PY -m pytest -q -p no:cacheprovider $KERNEL_TESTS > "$LOGS/kernel_tests.log" 2>&1 &
else
  $PY launch/gpu_check.py --tests-only > "$LOGS/kernel_tests.log" 2>&1 &
fi
TESTS=$!

SET="train.steps=30 train.eval_every=0 train.save_every=0 train.image_every=0"
for impl in auto torch; do
  stamp "training, 30 steps fp32, kernels: $impl"
  timeout 120 $PY launch/train.py --config configs/mixtral_small.json --run-dir "runs/gpu_$impl" --set $SET \
    model.attention.impl=$impl model.mamba.impl=$impl model.moe.impl=$impl > "$LOGS/train_$impl.log" 2>&1
  echo "exit $?"; tail -n 2 "$LOGS/train_$impl.log"
done
$PY - <<'EOF' | tee "$LOGS/train_compare.txt"
import json
runs = {k: [json.loads(l) for l in open(f"runs/gpu_{k}/metrics.jsonl") if '"loss"' in l] for k in ("auto", "torch")}
rel = [abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(runs["auto"], runs["torch"])]
print(f"steps compared {len(rel)}; max relative loss difference Triton vs PyTorch {max(rel):.2e}; "
      f"final losses {runs['auto'][-1]['loss']:.5f} / {runs['torch'][-1]['loss']:.5f}; "
      f"tokens/s at the end {runs['auto'][-1]['tokens_per_s']:.0f} / {runs['torch'][-1]['tokens_per_s']:.0f}")
EOF
stamp "default job (200 steps) in bf16"
timeout 150 $PY launch/train.py --config configs/mixtral_small.json --run-dir runs/gpu_default --set train.dtype=bf16 \
  > "$LOGS/train_default_bf16.log" 2>&1
echo "exit $?"; grep -h eval_loss runs/gpu_default/metrics.jsonl | cut -c1-200 | tail -n 3 > "$LOGS/default_eval.txt"
cat "$LOGS/default_eval.txt"

stamp "waiting for the kernel tests"
wait $TESTS; echo "kernel tests exit $?"; grep -E "^--- |passed|failed|Error" "$LOGS/kernel_tests.log" | head -n 30

if [ "${SKIP_BENCH:-0}" = 1 ]; then
  stamp "done (benchmarks skipped)"
  [ -n "${OUT:-}" ] && tar czf "$OUT/gpu_session.tgz" runs/gpu_session runs/gpu_*/metrics.jsonl 2>/dev/null
  exit 0
fi
stamp "benchmarks"
timeout 150 $PY launch/gpu_check.py --bench-only > "$LOGS/kernel_bench.log" 2>&1; tail -n 20 "$LOGS/kernel_bench.log"
B="timeout 90 $PY launch/bench.py"
{
  $B moe --tokens 4096 --d-model 512 --d-ff 1024 --experts 8 --top-k 2 --dtype bf16 --device cuda
  $B moe --tokens 4096 --d-model 512 --d-ff 256 --experts 64 --top-k 6 --dtype bf16 --device cuda
  $B moe --tokens 16384 --d-model 4096 --d-ff 14336 --experts 8 --top-k 2 --dtype bf16 --device cuda
  $B scan --batch 2 --seq 2048 --dim 512 --state 16 --device cuda
  $B step --config configs/mixtral_small.json --device cuda
  $B step --config configs/mixtral_small.json --device cuda --set train.dtype=bf16
} > "$LOGS/bench.log" 2>&1
grep -E '^\{' "$LOGS/bench.log"
stamp "done"
[ -n "${OUT:-}" ] && tar czf "$OUT/gpu_session.tgz" runs/gpu_session runs/gpu_*/metrics.jsonl 2>/dev/null
true
