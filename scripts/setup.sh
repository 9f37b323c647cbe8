#!/usr/bin/env bash
# Set up .venv with everything rlk_xla needs and build the compiled module (_rlk_core).
# Idempotent: a second run only rebuilds what changed. Needs Python >= 3.9, a C++17 compiler and
# CMake >= 3.24; with nvcc on PATH the CUDA backend is built too (RLK_CUDA=OFF skips it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
pip install -q --upgrade pip
pip install -q "jax>=0.6" numpy nanobind "scikit-build-core>=0.10" ninja pytest hypothesis
# torch_bridge is optional: a CPU build of torch is enough for its tests here.
python -c "import torch" 2>/dev/null || pip install -q "torch==2.13.0" \
  || echo "setup: torch not installed; torch_bridge tests will be skipped"
# --no-build-isolation: build against the jaxlib installed here, whose FFI headers it accepts.
pip install -q --no-build-isolation . 2>&1 | tail -n 20
python -c "import _rlk_core as c; print('setup: _rlk_core built; xla_ffi =', c.has_xla_ffi, '; cuda =', c.has_cuda)"
