// Run-time binding of the few cuBLAS entry points the backward uses (see blas.h for why).
#include "blas.h"

#include <dlfcn.h>
#include <library_types.h>

#include <cstdlib>
#include <mutex>

namespace rlk::cuda::blas {
namespace {

// The cuBLAS v2 ABI subset used here (stable across cuBLAS 11-13).
using Handle = void*;
using CreateFn = int (*)(Handle*);
using SetStreamFn = int (*)(Handle, cudaStream_t);
using SetWorkspaceFn = int (*)(Handle, void*, size_t);
using SetMathModeFn = int (*)(Handle, int);
using GemmExFn = int (*)(Handle, int, int, int, int, int, const void*, const void*, cudaDataType_t, int, const void*,
                         cudaDataType_t, int, const void*, void*, cudaDataType_t, int, int, int);
constexpr int kOpN = 0, kOpT = 1;
constexpr int kComputeF32 = 68;                 // CUBLAS_COMPUTE_32F (true fp32, no TF32)
constexpr int kGemmDefault = -1;                // CUBLAS_GEMM_DEFAULT
constexpr int kNoReducedPrecisionReduction = 16;  // CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION

struct Api {
  CreateFn create = nullptr;
  SetStreamFn set_stream = nullptr;
  SetWorkspaceFn set_workspace = nullptr;
  SetMathModeFn set_math_mode = nullptr;
  GemmExFn gemm_ex = nullptr;
  const char* error = nullptr;
};

void* open_library() {
  if (const char* path = std::getenv("RLK_CUBLAS_PATH")) return dlopen(path, RTLD_NOW | RTLD_LOCAL);
  for (const char* name : {"libcublas.so.13", "libcublas.so.12"})
    if (void* h = dlopen(name, RTLD_NOW | RTLD_NOLOAD)) return h;  // the one jax or torch loaded
  for (const char* name : {"libcublas.so.13", "libcublas.so.12", "libcublas.so"})
    if (void* h = dlopen(name, RTLD_NOW | RTLD_LOCAL)) return h;
  return nullptr;
}

const Api& api() {
  static Api a;
  static std::once_flag once;
  std::call_once(once, [] {
    void* lib = open_library();
    if (!lib) {
      a.error = "rlk cuda backward: cuBLAS not found (it ships with jax[cuda] and torch; or set RLK_CUBLAS_PATH)";
      return;
    }
    a.create = reinterpret_cast<CreateFn>(dlsym(lib, "cublasCreate_v2"));
    a.set_stream = reinterpret_cast<SetStreamFn>(dlsym(lib, "cublasSetStream_v2"));
    a.set_workspace = reinterpret_cast<SetWorkspaceFn>(dlsym(lib, "cublasSetWorkspace_v2"));
    a.set_math_mode = reinterpret_cast<SetMathModeFn>(dlsym(lib, "cublasSetMathMode"));
    a.gemm_ex = reinterpret_cast<GemmExFn>(dlsym(lib, "cublasGemmEx"));
    if (!a.create || !a.set_stream || !a.set_workspace || !a.set_math_mode || !a.gemm_ex)
      a.error = "rlk cuda backward: the loaded cuBLAS lacks cublasGemmEx/cublasSetWorkspace_v2 (needs cuBLAS >= 11)";
  });
  return a;
}

constexpr int kMaxDevices = 64;
struct DeviceHandle {
  std::mutex mu;  // one handle per device, shared by threads: stream/workspace/gemm under the lock
  Handle h = nullptr;
};
DeviceHandle g_handles[kMaxDevices];

Status handle_of(int dev, DeviceHandle** out) {
  const Api& a = api();
  if (a.error) return a.error;
  if (dev < 0 || dev >= kMaxDevices) return "rlk cuda backward: device index out of range";
  DeviceHandle& d = g_handles[dev];
  std::lock_guard<std::mutex> lock(d.mu);
  if (!d.h) {
    if (a.create(&d.h) != 0) {
      d.h = nullptr;
      return "rlk cuda backward: cublasCreate failed (first use inside a CUDA-graph capture? run one step first)";
    }
    a.set_math_mode(d.h, kNoReducedPrecisionReduction);
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

}  // namespace

Status prepare(int device) {
  int cur = 0;
  if (cudaGetDevice(&cur) != cudaSuccess || cudaSetDevice(device) != cudaSuccess) return "rlk cuda: bad device";
  DeviceHandle* d = nullptr;
  const Status s = handle_of(device, &d);
  cudaSetDevice(cur);
  return s;
}

// Row-major C[m, n] = A' B' is column-major C^T[n, m] = B'^T A'^T: cuBLAS gets (B, A) swapped,
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
  const float alpha = 1.f;
  std::lock_guard<std::mutex> lock(d->mu);
  void* ws = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(workspace) + 255) & ~uintptr_t(255));
  if (a.set_stream(d->h, stream) != 0 || a.set_workspace(d->h, ws, kWorkspaceBytes) != 0)
    return "rlk cuda backward: cuBLAS stream/workspace setup failed";
  const int st = a.gemm_ex(d->h, tb ? kOpT : kOpN, ta ? kOpT : kOpN, int(n), int(m), int(k), &alpha, B.ptr,
                           cuda_type(B.dtype), int(B.ld), A.ptr, cuda_type(A.dtype), int(A.ld), &beta, C,
                           cuda_type(c_dtype), int(ldc), kComputeF32, kGemmDefault);
  return st == 0 ? nullptr : "rlk cuda backward: cublasGemmEx failed";
}

}  // namespace rlk::cuda::blas
