#!/usr/bin/env bash
# Set up (scripts/setup.sh: venv, build) and run the test suite. GPU tests skip without a GPU.
#
#   bash scripts/test.sh            the whole suite: about 17 minutes on 2 CPU cores from a fresh clone
#                                   (the build about 1 minute; about 4 more with nvcc on PATH, which
#                                   compiles the CUDA kernels: RLK_CUDA=OFF skips them)
#   bash scripts/test.sh --quick    a few minutes (under 5 on 2 free cores from a fresh clone, build
#                                   included): the core correctness of both frontends and the README's
#                                   examples; without a GPU it builds the CPU kernels only
#   bash scripts/test.sh --wheel dist/rlk_xla-*.whl
#                                   no build: the wheel installed as a stranger would, into a fresh venv
#                                   (.venv-wheel) with no compiler, CMake or nvcc on PATH; then
#                                   `python -m rlk_xla check` and the suite against the installed packages
# Arguments after these go to pytest (e.g. -x, -k NAME, -m gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
quick=0 wheel=""
while [ "$#" -gt 0 ]; do
  case "$1" in
    --quick) quick=1; shift ;;
    --wheel) wheel=$(realpath "$2"); shift 2 ;;
    *) break ;;
  esac
done
# The quick subset (about 2.5 minutes of tests on 2 lightly loaded cores, 2026-12-07; 10 on 2 cores
# shared with other builds): both frontends against the float64 oracle (forward, gradients, odd shapes, dtypes,
# non-finite inputs), the shared rules, the README's examples.
QUICK=(tests/jax_tests/test_linear_logp.py tests/torch_tests/test_torch_linear_logp.py
       tests/torch_tests/test_torch_nonfinite.py tests/common_tests/test_common.py
       tests/common_tests/test_progress.py tests/test_readme.py)
# The torch scripts/setup.sh installs where there is no GPU (a CPU build where pip's configuration
# offers one); the wheel is tested with the same.
TORCH="torch==2.13.0"
# The integrations are tested against the real packages (scripts/setup.sh installs only what rlk_xla needs).
INTEGRATIONS=("transformers==5.24.0" "flax==0.12.8" "megatron-core==0.16.1" "trl==1.16.0"
              "google-metrax==0.2.4" "jaxtyping==0.3.11" "sentencepiece==0.2.3" "perfetto==0.59.1"
              "pillow==13.0.0")
# google-tunix 0.1.7 (the newest) pins safetensors<0.8, which transformers 5.24 (>=0.8) excludes: it goes in
# without its declared dependencies, plus the five above that its RL modules and models import beyond ours
# (pillow among them: without it `import tunix` fails and its tests would only be skipped).
TUNIX="google-tunix==0.1.7"
# Installed, then imported: an integration whose import fails is an error here, never a silent skip.
integrations() {
  pip install -q "${INTEGRATIONS[@]}" && pip install -q --no-deps "$TUNIX" &&
    python -c "import flax, megatron.core, transformers, trl, tunix.rl.common, tunix.models.qwen3.model" ||
    { echo "test: an integration package does not install or import (above)" >&2; return 1; }
}
start=$SECONDS

if [ -z "$wheel" ]; then
  if [ "$quick" = 1 ] && ! nvidia-smi -L >/dev/null 2>&1 && [ -z "${RLK_CUDA:-}" ]; then
    echo "test: --quick on a machine without a GPU: the CPU kernels only (RLK_CUDA=OFF)"
    export RLK_CUDA=OFF
  fi
  bash scripts/setup.sh
  # shellcheck disable=SC1091
  . .venv/bin/activate
  [ "$quick" = 1 ] || integrations
  echo "test: setup took $((SECONDS - start)) s"
  set +e
  if [ "$quick" = 1 ]; then
    python -m pytest -q "${QUICK[@]}" "$@"
  else
    python -m pytest -q tests "$@"
  fi
  rc=$?
else
  # A stranger's machine: a fresh venv, and a PATH of this machine's tools less every compiler,
  # CMake, ninja and nvcc, so that nothing can be built (pip must take the wheel as it is).
  venv=$repo/.venv-wheel
  cxx=$(command -v g++ || true)
  tools=$(mktemp -d)
  trap 'rm -rf "$tools"' EXIT
  rm -rf "$venv"
  "${PYTHON:-python3}" -m venv "$venv"
  IFS=: read -ra dirs <<<"$PATH"
  for d in "${dirs[@]}"; do
    for f in "$d"/*; do
      name=${f##*/}
      case "$name" in
        cc|c++|gcc|g++|gcc-[0-9]*|g++-[0-9]*|*-gcc|*-g++|*-gcc-[0-9]*|*-g++-[0-9]*|clang*|cmake|ctest|ninja|nvcc) continue ;;
      esac
      [ -x "$f" ] && [ ! -e "$tools/$name" ] && ln -s "$f" "$tools/$name"
    done
  done
  export PATH="$venv/bin:$tools"
  for tool in cc gcc g++ cmake nvcc ninja; do
    if command -v "$tool" >/dev/null; then echo "test: $tool is still on PATH" >&2; exit 1; fi
  done
  echo "test: installing $(basename "$wheel") into $venv (no compiler, CMake or nvcc on PATH)"
  pip install -q --upgrade pip
  pip install -q "$wheel" jax "$TORCH" pytest hypothesis
  [ "$quick" = 1 ] || integrations
  echo "test: installed in $((SECONDS - start)) s: $(pip list 2>/dev/null | grep -E '^(rlk_xla|jax|torch) ' | tr -s ' ' | paste -sd, -)"
  # From an empty folder, so that the source packages of this clone are not importable (conftest.py
  # checks, with RLK_TEST_INSTALLED=1, that rlk_xla comes from the venv).
  work=$(mktemp -d)
  cd "$work"
  python -m rlk_xla check --device cpu
  # torch.compile's Inductor compiles C++ for the CPU itself (a requirement of torch, not of this
  # wheel): it alone gets the compiler, through CXX.
  export CXX=${CXX:-$cxx} RLK_TEST_INSTALLED=1
  set +e
  if [ "$quick" = 1 ]; then
    python -m pytest -q --rootdir "$repo" -c "$repo/pyproject.toml" -p no:cacheprovider "${QUICK[@]/#/$repo/}" "$@"
  else
    python -m pytest -q --rootdir "$repo" -c "$repo/pyproject.toml" -p no:cacheprovider "$repo/tests" "$@"
  fi
  rc=$?
  cd "$repo"
fi
echo "test: $([ "$rc" = 0 ] && echo passed || echo FAILED) in $((SECONDS - start)) s in all"
exit "$rc"
