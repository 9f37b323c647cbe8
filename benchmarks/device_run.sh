#!/usr/bin/env bash
# On a GPU machine (the device tool; see docs/benchmarks.md): build this checkout into the machine's
# python and run the steps named on the command line, logs and results under $OUT.
#   build    install carried wheels (.whl/: liger-kernel, cut-cross-entropy, tokamax and what it imports:
#            nvidia-cutlass, einshape, qwix, jaxtyping, wadler-lindig, immutabledict) and build
#   test     pytest -m gpu (JAX and torch on one GPU); jaxtest: the JAX GPU tests only
#   check    python -m rlk_xla check
#   bench    benchmarks/bench_gpu.py over every shape of docs/design.md §6 (env BENCH_ARGS: more options)
#   benchpar one bench_gpu.py per GPU at once, GPU k taking the k-th ';'-separated shape list of
#            BENCH_SPLIT (e.g. "L16k,T1;T3,H200-pub"); results in $OUT/bench.tgz (gpuK/ folders)
#   trace    benchmarks/trace_torch.py (env TRACE_ARGS): where a torch_bridge step's GPU time goes
#   tp       benchmarks/tp_jax.py (JAX, all GPUs) and tp_torch.py (torchrun, NCCL), cross-frontend check
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/rlk-out
LOG="$OUT/run.log"  # one log: the device tool brings back at most 8 files
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
for step in "$@"; do
  case $step in
    build)
      nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv | tee -a "$LOG"
      t0=$(date +%s)
      python3 -m pip install -q --no-build-isolation -C build-dir=/tmp/rlk-build . 2>&1 | tail -n 30 | tee -a "$LOG"
      python3 -c "import _rlk_core as c; print('built: cuda', c.has_cuda, 'ffi', c.has_xla_ffi)" | tee -a "$LOG"
      echo "build took $(( $(date +%s) - t0 )) s" | tee -a "$LOG" ;;
    test)
      timeout ${TEST_TIMEOUT:-400} python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tail -n 40 | tee -a "$LOG"
      ;;
    check)
      timeout 120 python3 -m rlk_xla check 2>/dev/null | tee -a "$LOG" ;;
    bench)
      timeout ${BENCH_TIMEOUT:-540} python3 benchmarks/bench_gpu.py --out "$OUT" ${BENCH_ARGS:-} 2>/tmp/rlk-out/bench.err \
        | tail -n 60 | tee -a "$LOG"
      tail -n 20 /tmp/rlk-out/bench.err >> "$LOG" ;;
    benchpar)
      IFS=';' read -ra lists <<< "$BENCH_SPLIT"
      for k in "${!lists[@]}"; do
        CUDA_VISIBLE_DEVICES=$k timeout ${BENCH_TIMEOUT:-540} python3 benchmarks/bench_gpu.py --out /tmp/rlk-out/gpu$k \
          --shapes "${lists[$k]}" ${BENCH_ARGS:-} > /tmp/rlk-out/bench$k.log 2>&1 &
      done
      wait
      for k in "${!lists[@]}"; do tail -n 40 /tmp/rlk-out/bench$k.log | grep -v "it/s\]" >> "$LOG"; done
      (cd /tmp/rlk-out && tar czf "$OUT/bench.tgz" gpu*/ bench*.log) ;;
    trace)
      timeout ${TRACE_TIMEOUT:-300} python3 benchmarks/trace_torch.py ${TRACE_ARGS:-} 2>&1 | grep -v Warning | tee -a "$LOG" ;;
    jaxtest)
      timeout ${TEST_TIMEOUT:-400} python3 -m pytest -q -m gpu tests/jax_tests/test_jax_gpu.py -p no:cacheprovider 2>&1 | tail -n 40 | tee -a "$LOG"
      ;;
    tp)
      timeout ${TP_TIMEOUT:-240} python3 benchmarks/tp_jax.py --out /tmp/rlk-out 2>&1 | tee -a "$LOG"
      timeout ${TP_TIMEOUT:-240} torchrun --nproc_per_node "$(nvidia-smi -L | wc -l)" benchmarks/tp_torch.py --out /tmp/rlk-out 2>&1 \
        | grep -v Warning | tee -a "$LOG"
      cp /tmp/rlk-out/tp_*.json "$OUT"/
      python3 - /tmp/rlk-out <<'PY' | tee -a "$LOG"
import glob, os, sys, numpy as np
out = sys.argv[1]
for f in sorted(glob.glob(os.path.join(out, "tp_jax_*_logp.npy"))):
    name = os.path.basename(f)[len("tp_jax_"):-len("_logp.npy")]
    g = os.path.join(out, f"tp_torch_{name}_logp.npy")
    if os.path.exists(g):
        a, b = np.load(f), np.load(g)
        print(f"{name}: JAX TP logp vs torch TP logp bitwise equal: {np.array_equal(a, b)}; max |diff| {np.nanmax(np.abs(a - b)):.3g}")
PY
      ;;
  esac
done
