#!/usr/bin/env bash
# Wheels that let benchmarks/gpu_check/ run on a GPU machine with no network and no DeepSpeed: a pure-Python
# DeepSpeed wheel (no compiled ops: DS_BUILD_OPS=0; DeepSpeed compiles an op at first use if one is ever asked for,
# and moe_dist asks for none) and the cp312 wheels of what it imports that such a machine lacks. Into .whl/
# (git-ignored); see docs/benchmarks.md, "GPU check", for the one command that carries and installs them.
#
#   benchmarks/device/prepare_wheels.sh [--check]     # --check: rehearse the offline install in a Python 3.12 venv
#
# Versions: DeepSpeed and its dependencies at the versions installed here (pip show), so the device runs what CI
# tests. The machine's image already holds einops, msgpack, ninja, numpy, packaging, psutil, py-cpuinfo, tqdm and
# typing-extensions; hjson and pydantic (with pydantic-core, annotated-types, typing-inspection) travel.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=.whl
PY=${PYTHON:-python3}
PY312=${PY312:-$HOME/.pyenv/versions/3.12.1/bin/python}
version() { "$PY" -m pip show "$1" 2>/dev/null | sed -n 's/^Version: //p'; }

DS=$(version deepspeed)
[ -n "$DS" ] || { echo "prepare_wheels: deepspeed is not installed here (pip show deepspeed)" >&2; exit 2; }
rm -rf "$OUT" && mkdir -p "$OUT"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# DeepSpeed: its source distribution, built into a py3-none-any wheel with every op left to compile at first use.
"$PY" -m pip download -q --no-deps --no-binary :all: -d "$work" "deepspeed==$DS"
tar -xzf "$work"/deepspeed-"$DS".tar.gz -C "$work"
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$OUT" "$work/deepspeed-$DS"

# Its dependencies that the GPU machine's image does not hold, as CPython 3.12 manylinux wheels for x86-64.
deps=()
for name in hjson pydantic pydantic-core annotated-types typing-inspection; do
    v=$(version "$name")
    [ -n "$v" ] || { echo "prepare_wheels: $name is not installed here (pip show $name)" >&2; exit 2; }
    deps+=("$name==$v")
done
deps+=("fla-core==0.6.0")  # the Mamba-2 / Gated DeltaNet GPU kernels (pyproject extra `fla`), pure Python
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$OUT" "${deps[@]}"
ls -l "$OUT"
du -sh "$OUT"

if [ "${1:-}" = "--check" ]; then
    # The device's install line, offline, into a fresh Python 3.12 that also holds (as stand-ins, not carried) the
    # device image's own copies of DeepSpeed's other dependencies; there is no torch for 3.12 here, so the rehearsal
    # proves the wheels install, that nothing but torch is missing, and that `import deepspeed` gets as far as torch.
    [ -x "$PY312" ] || { echo "prepare_wheels: no Python 3.12 at $PY312 (set PY312)" >&2; exit 2; }
    "$PY312" -m venv "$work/venv"
    image=()
    for name in einops msgpack ninja numpy packaging psutil py-cpuinfo tqdm typing-extensions; do
        image+=("$name==$(version "$name")")
    done
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 \
        -d "$work/image" "${image[@]}"
    "$work/venv/bin/python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "$work"/image/*.whl
    site="$work/site"
    "$work/venv/bin/python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "$OUT"/*.whl
    PYTHONPATH="$site" "$work/venv/bin/python" benchmarks/device/check_wheels.py
fi
