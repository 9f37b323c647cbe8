#!/usr/bin/env bash
# Set up .venv with everything rlk_xla needs and build the compiled module (_rlk_core).
# Idempotent: a second run only rebuilds what changed. Needs Python >= 3.10, a C++17 compiler and
# CMake >= 3.24; with nvcc on PATH the CUDA backend is built too (RLK_CUDA=OFF skips it).
# On a machine with a working NVIDIA driver, jax comes with its CUDA plugin and torch is a CUDA
# build, both for the CUDA version the driver supports; elsewhere both are CPU builds.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
  || { echo "setup: rlk_xla needs Python >= 3.10; $PY is $("$PY" -V 2>&1) (set PYTHON=...)" >&2; exit 1; }
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
pip install -q --upgrade pip

# The newest CUDA the driver runs ("CUDA Version: 13.0" in nvidia-smi's header); empty without one.
cuda=$({ nvidia-smi 2>/dev/null || true; } | sed -n 's/.*CUDA Version: *\([0-9]*\)\.\([0-9]*\).*/\1.\2/p' | head -n 1)
major=${cuda%%.*} minor=${cuda#*.}
jax="jax>=0.6"
torch_index=""
if [ -z "$cuda" ]; then
  echo "setup: no working NVIDIA GPU (nvidia-smi): jax and torch for the CPU"
elif [ "$major" -ge 13 ]; then
  jax="jax[cuda13]>=0.6" torch_index=cu130
elif [ "$major" -eq 12 ]; then
  jax="jax[cuda12]>=0.6" torch_index=$([ "$minor" -ge 8 ] && echo cu128 || echo cu126)
else
  echo "setup: the NVIDIA driver runs CUDA $cuda, older than jax and torch need (12): CPU builds"
fi
pip install -q "$jax" numpy nanobind "scikit-build-core>=0.10" ninja pytest hypothesis
if [ -n "$torch_index" ]; then
  echo "setup: NVIDIA driver for CUDA $cuda: $jax and torch from https://download.pytorch.org/whl/$torch_index"
  command -v nvcc >/dev/null || echo "setup: no nvcc on PATH: _rlk_core gets no CUDA kernels (README, Install)"
  python -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null \
    || pip install -q --upgrade torch --index-url "https://download.pytorch.org/whl/$torch_index" \
    || echo "setup: CUDA torch not installed; torch_bridge tests will be skipped"
else
  # torch_bridge is optional: a CPU build of torch is enough for its tests here.
  python -c "import torch" 2>/dev/null || pip install -q "torch==2.13.0" \
    || echo "setup: torch not installed; torch_bridge tests will be skipped"
fi
python -c "import jax; print('setup: jax', jax.__version__, 'on', jax.default_backend())"
python -c "import torch; print('setup: torch', torch.__version__)" 2>/dev/null || true
# --no-build-isolation: build against the jaxlib installed here (its FFI headers), incrementally in
# a build folder of this environment's own (Python, venv, CUDA on or off), so that another
# environment's build (pip install . elsewhere, RLK_CUDA=OFF) does not make this one start over.
# cmake's progress ([step/steps] per file) is shown; the whole log is kept next to the build folder.
env_id=$(python -c 'import hashlib, sys, sysconfig; print(sysconfig.get_config_var("SOABI").split("-")[1], hashlib.sha1(sys.prefix.encode()).hexdigest()[:8], sep="-")')
build_dir="build/setup-$env_id-cuda-${RLK_CUDA:-ON}"
mkdir -p build
echo "setup: building _rlk_core in $build_dir (log: $build_dir.log)"
if ! pip install -v --no-build-isolation --config-settings=build-dir="$build_dir" . >"$build_dir.log" 2>&1 \
    < /dev/null; then
  tail -n 60 "$build_dir.log" >&2
  echo "setup: the build failed; the whole log: $build_dir.log" >&2
  exit 1
fi &
build_pid=$!
# Follow the log while pip runs: cmake's messages (rlk: ...), ninja's [step/steps], warnings.
tail -n +1 -F "$build_dir.log" 2>/dev/null --pid=$build_pid \
  | grep --line-buffered -E '^ *(\[[0-9]+/[0-9]+\] |-- rlk:|rlk:|CMake (Warning|Error))' | sed -u 's/^ */  /' || true
wait $build_pid
python -c "import _rlk_core as c; print('setup: _rlk_core built; xla_ffi =', c.has_xla_ffi, '; cuda =', c.has_cuda)"
