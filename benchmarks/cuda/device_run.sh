#!/bin/bash
# Build the CUDA backend + its test on the device machine and run: test, sanitizers, bench.
#   benchmarks/cuda/device_run.sh [test] [san] [bench] [gemm] [ab]   (any subset; logs under $OUT)
# ab: this tree's kernels against other builds: AB_DIR, folders (separated by ':') laid out like the
#   repository with other versions of any of its files (e.g. cuda/linear_logp_bwd.cu,
#   include/rlk/linear_logp.h, tests/cuda/lptest.cu: `git archive REV cuda include tests/cuda | tar
#   -x -C ab` before the run), benched over AB_SHAPES (default T1,T2,T3), all binaries interleaved
#   twice: machines differ by more than most changes, so only a same-machine A/B shows a few percent;
#   it ends with whether each build's outputs have this tree's bits per shape (lptest's BENCH bits).
set -o pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
# lptest (tests/cuda/lptest.cu) is a CMake target: the flags are CMakeLists.txt's.
build_lptest() {  # source tree, build dir
  cmake -S "$1" -B "$2" -G Ninja -DRLK_CUDA=ON -DRLK_BUILD_TESTS=ON -DPython_EXECUTABLE="$(command -v python3)" > "$2.log" 2>&1 \
    && cmake --build "$2" --target lptest >> "$2.log" 2>&1 || { tail -n 30 "$2.log"; echo BUILD FAILED; exit 1; }
}
B=/tmp/rlkbuild
build_lptest "$PWD" $B
# The backward's GEMMs are cuBLASLt's, loaded at run time (cuda/blas.h): the one jax's CUDA plugin ships.
export RLK_CUBLASLT_PATH=${RLK_CUBLASLT_PATH:-$(python3 -c "
import glob, sys
print(next(iter(sorted(f for p in sys.path for f in glob.glob(p + '/nvidia/*/lib/libcublasLt.so.1*'))), ''))")}
echo "cuBLASLt: $RLK_CUBLASLT_PATH"
echo "built $(date)"
for step in "$@"; do
  case $step in
    # a failing (or hanging) lptest stops the run: nothing after it would mean anything
    test) timeout 300 $B/lptest 2>&1 | tee $OUT/test.log || { echo "lptest failed: stopping"; exit 1; } ;;
    quick) timeout 150 $B/lptest --quick 2>&1 | tee $OUT/test.log || { echo "lptest failed: stopping"; exit 1; } ;;
    san) # keep every hazard's kernel names, then the summary
         for tool in memcheck racecheck; do
           timeout 400 compute-sanitizer --tool $tool --print-limit 5 $B/lptest --tiny > /tmp/san_$tool.log 2>&1
           { grep -E "Error|access at|Invalid|hazards\]" /tmp/san_$tool.log | head -n 40; tail -n 3 /tmp/san_$tool.log; } | tee $OUT/$tool.log
         done ;;
    bench) timeout 200 $B/lptest --bench 2>&1 | tee $OUT/bench.log ;;
    bench1) timeout 60 $B/lptest --bench --only T3 2>&1 | tee $OUT/bench.log ;;
    prof) timeout 200 ncu --clock-control none --metrics gpu__time_duration.sum --csv $B/lptest --profile --only ${PROF_SHAPE:-T3} > $OUT/ncu.csv 2>$OUT/ncu.err; tail -3 $OUT/ncu.err
          python3 benchmarks/cuda/ncu_summary.py $OUT/ncu.csv ;;
    ab) [ -n "${AB_DIR:-}" ] || { echo "ab: set AB_DIR to folders of kernel files (separated by ':')"; exit 1; }
        others=""; k=0
        for dir in $(echo $AB_DIR | tr : ' '); do  # each a build of its own, A/B'd against this tree's
          [ -d "$dir" ] || { echo "ab: $dir is not a folder"; exit 1; }
          k=$((k + 1)); A=/tmp/rlkab$k; rm -rf $A-src; mkdir -p $A-src
          tar --exclude=./build --exclude=./.git -cf - . | tar -xf - -C $A-src && cp -r "$dir"/. $A-src/
          build_lptest $A-src $A; others="$others $A"; echo "ab: $A is $dir"
        done
        shapes=$(echo ${AB_SHAPES:-T1,T2,T3} | tr , ' ')
        for r in 1 2; do for b in $B $others; do for s in $shapes; do
          timeout 60 $b/lptest --bench --only $s | grep BENCH | sed "s|^|$b/lptest: |"
        done; done; done 2>&1 | tee $OUT/ab.log
        # the outputs' fingerprints (BENCH bits) of each build against this tree's, shape by shape
        bits() { grep "^$1/lptest: BENCH bits $2 " $OUT/ab.log | sed 's/.*BENCH bits *[^ ]* //' | sort -u; }  # build, shape
        for A in $others; do for s in $shapes; do
          if [ -z "$(bits $B $s)" ] || [ -z "$(bits $A $s)" ]; then echo "ab bits $A $s: not compared (a build without fingerprints)"
          elif [ "$(bits $B $s)" = "$(bits $A $s)" ]; then echo "ab bits $A $s: same"; else echo "ab bits $A $s: DIFFER"; fi
        done; done | tee -a $OUT/ab.log ;;
    gemm) python3 - <<'PY' 2>&1 | tee $OUT/gemm.log
import torch, triton
for name,n,h,v in [("T1",796,2048,75968),("T2",1820,2048,75968),("T3",6827,2048,75968),("T3-tp1",6827,2048,151936),("H200-pub",4096,4096,128256),("L16k",16384,4096,151936)]:
    a=torch.randn(n,h,device='cuda',dtype=torch.bfloat16); w=torch.randn(v,h,device='cuda',dtype=torch.bfloat16)
    t=triton.testing.do_bench(lambda: a@w.t(), return_mode='median')
    print(f"GEMM {name:9s} {t:8.3f} ms  {2*n*h*v/t*1e-9:5.0f} TFLOP/s", flush=True)
    del a,w; torch.cuda.empty_cache()
PY
    ;;
  esac
done
