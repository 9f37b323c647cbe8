// Run-time binding of the few cuBLASLt entry points the backward uses (see blas.h for why).
#include "blas.h"

#include <dlfcn.h>
#include <library_types.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

namespace rlk::cuda::blas {
namespace {

// The cuBLASLt ABI subset used here (stable across cuBLAS 11-13; values from cublasLt.h).
using Handle = void*;
using Desc = void*;
using Layout = void*;
using Pref = void*;
struct Algo {
  uint64_t data[8];
};
struct Heuristic {
  Algo algo;
  size_t workspace_bytes;
  int state;
  float waves;
  int reserved[4];
};
using CreateFn = int (*)(Handle*);
using DescCreateFn = int (*)(Desc*, int, cudaDataType_t);
using DescSetFn = int (*)(Desc, int, const void*, size_t);
using DescDestroyFn = int (*)(Desc);
using LayoutCreateFn = int (*)(Layout*, cudaDataType_t, uint64_t, uint64_t, int64_t);
using LayoutDestroyFn = int (*)(Layout);
using PrefCreateFn = int (*)(Pref*);
using PrefSetFn = int (*)(Pref, int, const void*, size_t);
using PrefDestroyFn = int (*)(Pref);
using HeuristicFn = int (*)(Handle, Desc, Layout, Layout, Layout, Layout, Pref, int, Heuristic*, int*);
using MatmulFn = int (*)(Handle, Desc, const void*, const void*, Layout, const void*, Layout, const void*, const void*,
                         Layout, void*, Layout, const Algo*, void*, size_t, cudaStream_t);
using AlgoCheckFn = int (*)(Handle, Desc, Layout, Layout, Layout, Layout, const Algo*, Heuristic*);
constexpr int kOpN = 0, kOpT = 1;
constexpr int kComputeF32 = 68;  // CUBLAS_COMPUTE_32F (true fp32, no TF32)
constexpr int kDescTransA = 3, kDescTransB = 4;
constexpr int kPrefMaxWorkspace = 1, kPrefReductionMask = 3;
constexpr int kPrefMinAlignA = 5, kPrefMinAlignB = 6, kPrefMinAlignC = 7, kPrefMinAlignD = 8;
constexpr uint32_t kReductionNone = 0, kReductionFp32 = 2;  // NONE; COMPUTE_TYPE (fp32 partials in the workspace)

struct Api {
  CreateFn create = nullptr;
  DescCreateFn desc_create = nullptr;
  DescSetFn desc_set = nullptr;
  DescDestroyFn desc_destroy = nullptr;
  LayoutCreateFn layout_create = nullptr;
  LayoutDestroyFn layout_destroy = nullptr;
  PrefCreateFn pref_create = nullptr;
  PrefSetFn pref_set = nullptr;
  PrefDestroyFn pref_destroy = nullptr;
  HeuristicFn heuristic = nullptr;
  MatmulFn matmul = nullptr;
  AlgoCheckFn algo_check = nullptr;
  const char* error = nullptr;
};

void* open_library() {
  if (const char* path = std::getenv("RLK_CUBLASLT_PATH")) return dlopen(path, RTLD_NOW | RTLD_LOCAL);
  for (const char* name : {"libcublasLt.so.13", "libcublasLt.so.12"})
    if (void* h = dlopen(name, RTLD_NOW | RTLD_NOLOAD)) return h;  // the one jax or torch loaded
  for (const char* name : {"libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"})
    if (void* h = dlopen(name, RTLD_NOW | RTLD_LOCAL)) return h;
  return nullptr;
}

template <typename F> void bind(void* lib, const char* name, F& f) { f = reinterpret_cast<F>(dlsym(lib, name)); }

const Api& api() {
  static Api a;
  static std::once_flag once;
  std::call_once(once, [] {
    void* lib = open_library();
    if (!lib) {
      a.error = "rlk cuda backward: cuBLASLt not found (it ships with jax[cuda] and torch; or set RLK_CUBLASLT_PATH)";
      return;
    }
    bind(lib, "cublasLtCreate", a.create);
    bind(lib, "cublasLtMatmulDescCreate", a.desc_create);
    bind(lib, "cublasLtMatmulDescSetAttribute", a.desc_set);
    bind(lib, "cublasLtMatmulDescDestroy", a.desc_destroy);
    bind(lib, "cublasLtMatrixLayoutCreate", a.layout_create);
    bind(lib, "cublasLtMatrixLayoutDestroy", a.layout_destroy);
    bind(lib, "cublasLtMatmulPreferenceCreate", a.pref_create);
    bind(lib, "cublasLtMatmulPreferenceSetAttribute", a.pref_set);
    bind(lib, "cublasLtMatmulPreferenceDestroy", a.pref_destroy);
    bind(lib, "cublasLtMatmulAlgoGetHeuristic", a.heuristic);
    bind(lib, "cublasLtMatmul", a.matmul);
    bind(lib, "cublasLtMatmulAlgoCheck", a.algo_check);
    if (!a.create || !a.desc_create || !a.desc_set || !a.desc_destroy || !a.layout_create || !a.layout_destroy ||
        !a.pref_create || !a.pref_set || !a.pref_destroy || !a.heuristic || !a.matmul || !a.algo_check)
      a.error = "rlk cuda backward: the loaded cuBLASLt lacks an entry point this build needs (needs cuBLAS >= 11)";
  });
  return a;
}

// A GEMM as cuBLASLt sees it (column-major): what its algorithm depends on.
struct Key {
  int64_t m, n, k, lda, ldb, ldc;
  int ta, tb, a_type, b_type, c_type;
  uint32_t align_a, align_b, align_c;
  bool accumulate;  // beta != 0 (only a call with beta = 0 may be tuned)
  bool operator<(const Key& o) const {
    return std::tie(m, n, k, lda, ldb, ldc, ta, tb, a_type, b_type, c_type, align_a, align_b, align_c, accumulate) <
           std::tie(o.m, o.n, o.k, o.lda, o.ldb, o.ldc, o.ta, o.tb, o.a_type, o.b_type, o.c_type, o.align_a, o.align_b,
                    o.align_c, o.accumulate);
  }
};

constexpr int kMaxDevices = 64;
constexpr size_t kMaxCachedAlgos = 4096;  // (n varies from batch to batch: bounded, refilled)
struct DeviceHandle {
  std::mutex mu;  // one handle per device, shared by threads: its algorithm cache under the lock
  Handle h = nullptr;
  std::map<Key, Algo> algos;   // the algorithm each exact key runs (choose)
  std::map<Key, Algo> firsts;  // first_pick's, per pick key
  std::map<Key, Algo> tuned;   // the tuned pick, per size class (tune_class)
};
DeviceHandle g_handles[kMaxDevices];

Status handle_of(int dev, DeviceHandle** out) {
  const Api& a = api();
  if (a.error) return a.error;
  if (dev < 0 || dev >= kMaxDevices) return "rlk cuda backward: device index out of range";
  DeviceHandle& d = g_handles[dev];
  std::lock_guard<std::mutex> lock(d.mu);
  if (!d.h && a.create(&d.h) != 0) {
    d.h = nullptr;
    return "rlk cuda backward: cublasLtCreate failed (first use inside a CUDA-graph capture? run one step first)";
  }
  *out = &d;
  return nullptr;
}

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::kF32: return CUDA_R_32F;
    case DType::kF16: return CUDA_R_16F;
    default: return CUDA_R_16BF;
  }
}

bool fits_int(int64_t x) { return x >= 0 && x <= INT32_MAX; }

// The largest power of two (at most 256) that divides the address: what an algorithm may assume.
uint32_t alignment(const void* p) {
  const uintptr_t x = reinterpret_cast<uintptr_t>(p) | 256;
  return uint32_t(x & ~(x - 1));
}

// The descriptors of one call, destroyed with it (host objects, cheap to make).
struct Objects {
  const Api& a;
  Desc desc = nullptr;
  Layout la = nullptr, lb = nullptr, lc = nullptr;
  Pref pref = nullptr;
  ~Objects() {
    if (pref) a.pref_destroy(pref);
    for (Layout l : {la, lb, lc})
      if (l) a.layout_destroy(l);
    if (desc) a.desc_destroy(desc);
  }
};

// The preference of a call: the workspace it gets and its operands' alignments.
Status make_pref(const Api& a, const Key& key, Objects& o) {
  if (o.pref) return nullptr;
  const uint64_t ws = kWorkspaceBytes;
  if (a.pref_create(&o.pref) != 0 || a.pref_set(o.pref, kPrefMaxWorkspace, &ws, sizeof ws) != 0 ||
      a.pref_set(o.pref, kPrefMinAlignA, &key.align_a, sizeof key.align_a) != 0 ||
      a.pref_set(o.pref, kPrefMinAlignB, &key.align_b, sizeof key.align_b) != 0 ||
      a.pref_set(o.pref, kPrefMinAlignC, &key.align_c, sizeof key.align_c) != 0 ||
      a.pref_set(o.pref, kPrefMinAlignD, &key.align_c, sizeof key.align_c) != 0)
    return "rlk cuda backward: cuBLASLt preference setup failed";
  return nullptr;
}

// Up to `count` of cuBLASLt's candidates with reduction scheme `mask`, best guess first.
int candidates(const Api& a, DeviceHandle& d, Objects& o, uint32_t mask, int count, Heuristic* out) {
  int found = 0;
  if (a.pref_set(o.pref, kPrefReductionMask, &mask, sizeof mask) != 0 ||
      a.heuristic(d.h, o.desc, o.la, o.lb, o.lc, o.lc, o.pref, count, out, &found) != 0)
    return 0;
  int usable = 0;
  for (int i = 0; i < found; ++i)
    if (out[i].state == 0) out[usable++] = out[i];
  return usable;
}

// The algorithm: cuBLASLt's first pick among those that do not split K, so every output element
// sums its k terms in one pass, in one order, and no split-K partials meet in memory (cuBLAS's
// split-K kernels are where compute-sanitizer's racecheck reported hazards). Operands too
// misaligned for any such algorithm take cuBLASLt's first pick among those that reduce in fp32
// partials in the workspace (never in the 16-bit output).
Status first_pick(const Api& a, DeviceHandle& d, const Key& key, Objects& o, Algo* algo) {
  if (Status s = make_pref(a, key, o)) return s;
  for (const uint32_t mask : {kReductionNone, kReductionFp32}) {
    Heuristic h{};
    if (candidates(a, d, o, mask, 1, &h) > 0) return *algo = h.algo, nullptr;
  }
  return "rlk cuda backward: cuBLASLt has no algorithm for this GEMM";
}

// Batch rows (gemm's batch_rows: C's rows are tokens, as in the fast path's dH = dlogit W): the
// first pick is made once for kPinnedRows rows, whatever the call's count, and every other
// algorithm such a GEMM runs (the tuned ones) is admitted only with that pick's bits on the call's
// own operands. No algorithm splits K, so an output element's bits do not depend on the rows
// beside it: a token's dH is the same in a batch of 1 or of 16384. (Each row count's own first
// pick would do so only as far as measured: at one H and V they span up to seven tile
// configurations.) 1024: of 1024, 4096 and 16384, its pick was the fastest at
// most row counts; the timings against each row count's own pick: docs/benchmarks.md §5, "One dH
// algorithm for every row count" (`lt_candidates.py --rows`).
constexpr int64_t kPinnedRows = 1024;

// ---- the tuned pick -----------------------------------------------------------------------------
// The heuristic's first pick can be several percent slower than one of its next candidates
// (docs/benchmarks.md §5, "the tuned cuBLASLt pick"). So a GEMM of kTuneFlops and up is timed
// once per size class with the first kTuneCandidates no-split candidates, on the call's own
// operands, and the fastest is kept. The bits cannot change with it: a candidate is admitted only
// if its output has the first pick's bits (every no-split candidate measured so far does: they
// sum k in the same order; benchmarks/cuda/lt_candidates.py's "bits = #0" column). Only where the
// timing is safe: beta = 0 (C is only written, so the runs may repeat), a stream not being
// captured into a CUDA graph (a capture keeps the pick it finds, tuned or first: the same bits),
// and RLK_BLAS_TUNE not "0". Costs one host synchronization and about 3 x kTuneCandidates runs of
// the GEMM, once per class; the size class makes a batch whose token count varies from step to
// step tune a few times, not every step.
constexpr double kTuneFlops = 2e11;  // T1's gradient GEMMs' size: tuning pays off within a few steps (§5)
constexpr int kTuneCandidates = 4;
constexpr int64_t kSampleRows = 256;  // output rows compared per candidate (evenly spread)

int64_t pow2_ceil(int64_t x) {
  int64_t p = 1;
  while (p < x) p <<= 1;
  return p;
}

// GEMMs whose dimensions round up to the same powers of two share a tuned pick.
Key tune_class(Key key) {
  key.m = pow2_ceil(key.m), key.n = pow2_ceil(key.n), key.k = pow2_ceil(key.k);
  key.lda = key.ldb = key.ldc = 0;
  return key;
}

bool tuning_on() {
  static const bool on = [] {
    const char* e = std::getenv("RLK_BLAS_TUNE");
    return !(e && e[0] == '0');
  }();
  return on;
}

// True while `stream` is being captured into a CUDA graph (or when that cannot be told).
bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus cs;
  return cudaStreamIsCapturing(stream, &cs) != cudaSuccess || cs != cudaStreamCaptureStatusNone;
}

// One GEMM call, runnable with any algorithm.
struct Call {
  const Api& a;
  DeviceHandle& d;
  Objects& o;
  const void *x, *y;  // column-major operands (B', A')
  void* c;
  int64_t c_rows, c_cols, ldc, c_bytes;  // row-major C as the caller sees it; element size
  float beta;
  void* ws;
  cudaStream_t stream;
  int run(const Algo& algo) const {
    const float alpha = 1.f;
    return a.matmul(d.h, o.desc, &alpha, x, o.la, y, o.lb, &beta, c, o.lc, c, o.lc, &algo, ws, kWorkspaceBytes, stream);
  }
  bool fits(const Algo& algo) const {
    Heuristic h{};
    return a.algo_check(d.h, o.desc, o.la, o.lb, o.lc, o.lc, &algo, &h) == 0 && h.workspace_bytes <= kWorkspaceBytes;
  }
  // Every (c_rows / kSampleRows)-th row of C, on the host (after the stream's work).
  bool sample(std::vector<unsigned char>& out) const {
    const int64_t step = std::max<int64_t>(1, c_rows / kSampleRows), rows = (c_rows + step - 1) / step;
    out.resize(size_t(rows * c_cols * c_bytes));
    return cudaMemcpy2DAsync(out.data(), size_t(c_cols * c_bytes), c, size_t(step * ldc * c_bytes),
                             size_t(c_cols * c_bytes), size_t(rows), cudaMemcpyDeviceToHost, stream) == cudaSuccess &&
           cudaStreamSynchronize(stream) == cudaSuccess;
  }
};

// Milliseconds of two runs after a warm one, or a negative number if a run failed.
float time_runs(const Call& call, const Algo& algo, cudaEvent_t start, cudaEvent_t stop) {
  if (call.run(algo) != 0 || cudaEventRecord(start, call.stream) != cudaSuccess || call.run(algo) != 0 ||
      call.run(algo) != 0 || cudaEventRecord(stop, call.stream) != cudaSuccess ||
      cudaEventSynchronize(stop) != cudaSuccess)
    return -1.f;
  float ms = 0.f;
  return cudaEventElapsedTime(&ms, start, stop) == cudaSuccess ? ms : -1.f;
}

// The fastest candidate with the first pick's bits; `first` if none is faster or anything fails.
// C is left with the last candidate's output: gemm() then runs the one chosen.
Algo tune(const Call& call, const Key& key, const Algo& first) {
  Heuristic h[kTuneCandidates];
  if (make_pref(call.a, key, call.o)) return first;
  const int found = candidates(call.a, call.d, call.o, kReductionNone, kTuneCandidates, h);
  cudaEvent_t start = nullptr, stop = nullptr;
  if (cudaEventCreate(&start) != cudaSuccess || cudaEventCreate(&stop) != cudaSuccess) {
    if (start) cudaEventDestroy(start);
    return first;
  }
  Algo best = first;
  std::vector<unsigned char> ref, out;
  float best_ms = time_runs(call, first, start, stop);
  if (best_ms < 0.f || !call.sample(ref)) best_ms = -1.f;
  for (int i = 0; i < found && best_ms >= 0.f; ++i) {
    if (std::memcmp(&h[i].algo, &first, sizeof first) == 0) continue;
    const float ms = time_runs(call, h[i].algo, start, stop);
    if (ms >= 0.f && ms < best_ms && call.sample(out) && out == ref) best = h[i].algo, best_ms = ms;
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return best;
}

// The algorithm of an exact key, chosen once: the first pick of its pick key (the key itself, or
// for batch rows the key at kPinnedRows rows, whose descriptors describe_pick(Objects&) makes,
// only when that pick is not cached yet), or, where tuning applies, the tuned one of the key's
// size class: a candidate admitted only with the first pick's bits on its operands, so every
// algorithm a pick key runs gives its first pick's bits. A key met first inside a graph capture
// runs the first pick there and is chosen for good at its first call outside one.
template <class DescribePick>
Status choose(const Call& call, const Key& key, const Key& pick, DescribePick&& describe_pick, Algo* algo) {
  DeviceHandle& d = call.d;
  if (auto it = d.algos.find(key); it != d.algos.end()) return *algo = it->second, nullptr;
  if (auto it = d.firsts.find(pick); it != d.firsts.end()) {
    *algo = it->second;
  } else {
    const bool pinned = pick.n != key.n;  // (pick differs from key in C's rows alone)
    Objects pick_o{call.a};
    if (pinned)
      if (Status s = describe_pick(pick_o)) return s;
    if (Status s = first_pick(call.a, d, pick, pinned ? pick_o : call.o, algo)) return s;
    if (d.firsts.size() >= kMaxCachedAlgos) d.firsts.clear();
    d.firsts.emplace(pick, *algo);
  }
  if (!call.fits(*algo))
    return "rlk cuda backward: cuBLASLt's algorithm for every row count of this GEMM does not take this one";
  if (tuning_on() && !key.accumulate && 2.0 * double(key.m) * double(key.n) * double(key.k) >= kTuneFlops) {
    const Key cls = tune_class(key);
    if (auto it = d.tuned.find(cls); it != d.tuned.end()) {
      if (call.fits(it->second)) *algo = it->second;
    } else if (capturing(call.stream)) {
      return nullptr;  // not cached: tuned outside the capture
    } else {
      *algo = d.tuned.emplace(cls, tune(call, key, *algo)).first->second;
    }
  }
  if (d.algos.size() >= kMaxCachedAlgos) d.algos.clear();
  d.algos.emplace(key, *algo);
  return nullptr;
}

// The descriptors of a GEMM of `rows` rows of C, operands as in gemm() (A' then has `rows` rows).
Status describe(const Api& a, const Mat& A, bool ta, const Mat& B, bool tb, DType c_dtype, int64_t ldc, int64_t rows,
                Objects& o) {
  const int64_t k = ta ? A.rows : A.cols, n = tb ? B.rows : B.cols;
  const int op_x = tb ? kOpT : kOpN, op_y = ta ? kOpT : kOpN;
  if (a.desc_create(&o.desc, kComputeF32, CUDA_R_32F) != 0 ||
      a.desc_set(o.desc, kDescTransA, &op_x, sizeof op_x) != 0 ||
      a.desc_set(o.desc, kDescTransB, &op_y, sizeof op_y) != 0 ||
      a.layout_create(&o.la, cuda_type(B.dtype), tb ? k : n, tb ? n : k, B.ld) != 0 ||
      a.layout_create(&o.lb, cuda_type(A.dtype), ta ? rows : k, ta ? k : rows, A.ld) != 0 ||
      a.layout_create(&o.lc, cuda_type(c_dtype), n, rows, ldc) != 0)
    return "rlk cuda backward: cuBLASLt descriptor setup failed";
  return nullptr;
}

}  // namespace

Status prepare(int device) {
  int cur = 0;
  if (cudaGetDevice(&cur) != cudaSuccess || cudaSetDevice(device) != cudaSuccess) return "rlk cuda: bad device";
  DeviceHandle* d = nullptr;
  const Status s = handle_of(device, &d);
  cudaSetDevice(cur);
  return s;
}

// Row-major C[m, n] = A' B' is column-major C^T[n, m] = B'^T A'^T: cuBLASLt gets (B, A) swapped,
// each with its own transpose flag, and the row strides as leading dimensions.
Status gemm(cudaStream_t stream, void* workspace, const Mat& A, bool ta, const Mat& B, bool tb, void* C, DType c_dtype,
            int64_t ldc, float beta, bool batch_rows) {
  const int64_t m = ta ? A.cols : A.rows, k = ta ? A.rows : A.cols;
  const int64_t n = tb ? B.rows : B.cols;
  if ((tb ? B.cols : B.rows) != k) return "rlk cuda backward: GEMM shapes disagree";
  if (ta && batch_rows) return "rlk cuda backward: batch rows are the rows of an untransposed A";
  if (m == 0 || n == 0) return nullptr;
  if (!fits_int(m) || !fits_int(n) || !fits_int(k) || !fits_int(A.ld) || !fits_int(B.ld) || !fits_int(ldc))
    return "rlk cuda backward: a GEMM dimension exceeds 2^31";
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return "rlk cuda backward: no device";
  DeviceHandle* d = nullptr;
  if (Status s = handle_of(dev, &d)) return s;
  const Api& a = api();
  const Key key{n,
                m,
                k,
                B.ld,
                A.ld,
                ldc,
                tb ? kOpT : kOpN,
                ta ? kOpT : kOpN,
                int(cuda_type(B.dtype)),
                int(cuda_type(A.dtype)),
                int(cuda_type(c_dtype)),
                alignment(B.ptr),
                alignment(A.ptr),
                alignment(C),
                beta != 0.f};
  Key pick = key;
  if (batch_rows) pick.n = kPinnedRows;  // (cuBLASLt's n: C's rows)
  Objects o{a};
  if (Status s = describe(a, A, ta, B, tb, c_dtype, ldc, m, o)) return s;
  auto describe_pick = [&](Objects& po) { return describe(a, A, ta, B, tb, c_dtype, ldc, kPinnedRows, po); };
  void* ws = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(workspace) + 255) & ~uintptr_t(255));
  std::lock_guard<std::mutex> lock(d->mu);
  const Call call{a, *d, o, B.ptr, A.ptr, C, m, n, ldc, int64_t(dtype_bytes(c_dtype)), beta, ws, stream};
  Algo algo;
  if (Status s = choose(call, key, pick, describe_pick, &algo)) return s;
  return call.run(algo) == 0 ? nullptr : "rlk cuda backward: cublasLtMatmul failed";
}

}  // namespace rlk::cuda::blas
