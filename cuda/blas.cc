// Run-time binding of the few cuBLASLt entry points the backward uses (see blas.h for why).
#include "blas.h"

#include <dlfcn.h>
#include <library_types.h>

#include <cstdlib>
#include <map>
#include <mutex>
#include <tuple>

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
    if (!a.create || !a.desc_create || !a.desc_set || !a.desc_destroy || !a.layout_create || !a.layout_destroy ||
        !a.pref_create || !a.pref_set || !a.pref_destroy || !a.heuristic || !a.matmul)
      a.error = "rlk cuda backward: the loaded cuBLASLt lacks an entry point this build needs (needs cuBLAS >= 11)";
  });
  return a;
}

// A GEMM as cuBLASLt sees it (column-major): what its algorithm depends on.
struct Key {
  int64_t m, n, k, lda, ldb, ldc;
  int ta, tb, a_type, b_type, c_type;
  uint32_t align_a, align_b, align_c;
  bool operator<(const Key& o) const {
    return std::tie(m, n, k, lda, ldb, ldc, ta, tb, a_type, b_type, c_type, align_a, align_b, align_c) <
           std::tie(o.m, o.n, o.k, o.lda, o.ldb, o.ldc, o.ta, o.tb, o.a_type, o.b_type, o.c_type, o.align_a, o.align_b,
                    o.align_c);
  }
};

constexpr int kMaxDevices = 64;
constexpr size_t kMaxCachedAlgos = 4096;  // (n varies from batch to batch: bounded, refilled)
struct DeviceHandle {
  std::mutex mu;  // one handle per device, shared by threads: its algorithm cache under the lock
  Handle h = nullptr;
  std::map<Key, Algo> algos;
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

// The algorithm: cuBLASLt's first pick among those that do not split K, so every output element
// sums its k terms in one pass, in one order, and no split-K partials meet in memory (cuBLAS's
// split-K kernels are where compute-sanitizer's racecheck reported hazards). Operands too
// misaligned for any such algorithm take cuBLASLt's first pick among those that reduce in fp32
// partials in the workspace (never in the 16-bit output).
Status pick_algo(const Api& a, DeviceHandle& d, const Key& key, Objects& o, Algo* algo) {
  if (auto it = d.algos.find(key); it != d.algos.end()) return *algo = it->second, nullptr;
  if (a.pref_create(&o.pref) != 0) return "rlk cuda backward: cuBLASLt preference setup failed";
  const uint64_t ws = kWorkspaceBytes;
  if (a.pref_set(o.pref, kPrefMaxWorkspace, &ws, sizeof ws) != 0 ||
      a.pref_set(o.pref, kPrefMinAlignA, &key.align_a, sizeof key.align_a) != 0 ||
      a.pref_set(o.pref, kPrefMinAlignB, &key.align_b, sizeof key.align_b) != 0 ||
      a.pref_set(o.pref, kPrefMinAlignC, &key.align_c, sizeof key.align_c) != 0 ||
      a.pref_set(o.pref, kPrefMinAlignD, &key.align_c, sizeof key.align_c) != 0)
    return "rlk cuda backward: cuBLASLt preference setup failed";
  for (const uint32_t mask : {kReductionNone, kReductionFp32}) {
    if (a.pref_set(o.pref, kPrefReductionMask, &mask, sizeof mask) != 0)
      return "rlk cuda backward: cuBLASLt preference setup failed";
    Heuristic h{};
    int found = 0;
    if (a.heuristic(d.h, o.desc, o.la, o.lb, o.lc, o.lc, o.pref, 1, &h, &found) == 0 && found > 0 && h.state == 0) {
      if (d.algos.size() >= kMaxCachedAlgos) d.algos.clear();
      d.algos.emplace(key, h.algo);
      return *algo = h.algo, nullptr;
    }
  }
  return "rlk cuda backward: cuBLASLt has no algorithm for this GEMM";
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
Status gemm(cudaStream_t stream, void* workspace, const Mat& A, bool ta, const Mat& B, bool tb, void* C,
            DType c_dtype, int64_t ldc, float beta) {
  const int64_t m = ta ? A.cols : A.rows, k = ta ? A.rows : A.cols;
  const int64_t n = tb ? B.rows : B.cols;
  if ((tb ? B.cols : B.rows) != k) return "rlk cuda backward: GEMM shapes disagree";
  if (m == 0 || n == 0) return nullptr;
  if (!fits_int(m) || !fits_int(n) || !fits_int(k) || !fits_int(A.ld) || !fits_int(B.ld) || !fits_int(ldc))
    return "rlk cuda backward: a GEMM dimension exceeds 2^31";
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return "rlk cuda backward: no device";
  DeviceHandle* d = nullptr;
  if (Status s = handle_of(dev, &d)) return s;
  const Api& a = api();
  // column-major operands: X = B' (n x k), Y = A' (k x m), as stored: B is (tb ? n x k : k x n)
  const int op_x = tb ? kOpT : kOpN, op_y = ta ? kOpT : kOpN;
  const Key key{n, m, k, B.ld, A.ld, ldc, op_x, op_y, int(cuda_type(B.dtype)), int(cuda_type(A.dtype)),
                int(cuda_type(c_dtype)), alignment(B.ptr), alignment(A.ptr), alignment(C)};
  Objects o{a};
  if (a.desc_create(&o.desc, kComputeF32, CUDA_R_32F) != 0 ||
      a.desc_set(o.desc, kDescTransA, &op_x, sizeof op_x) != 0 || a.desc_set(o.desc, kDescTransB, &op_y, sizeof op_y) != 0 ||
      a.layout_create(&o.la, cuda_type(B.dtype), tb ? k : n, tb ? n : k, B.ld) != 0 ||
      a.layout_create(&o.lb, cuda_type(A.dtype), ta ? m : k, ta ? k : m, A.ld) != 0 ||
      a.layout_create(&o.lc, cuda_type(c_dtype), n, m, ldc) != 0)
    return "rlk cuda backward: cuBLASLt descriptor setup failed";
  const float alpha = 1.f;
  void* ws = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(workspace) + 255) & ~uintptr_t(255));
  std::lock_guard<std::mutex> lock(d->mu);
  Algo algo;
  if (Status s = pick_algo(a, *d, key, o, &algo)) return s;
  const int st = a.matmul(d->h, o.desc, &alpha, B.ptr, o.la, A.ptr, o.lb, &beta, C, o.lc, C, o.lc, &algo, ws,
                          kWorkspaceBytes, stream);
  return st == 0 ? nullptr : "rlk cuda backward: cublasLtMatmul failed";
}

}  // namespace rlk::cuda::blas
