// Standalone test and benchmark of the CUDA backend (rlk::cuda::forward/combine/backward).
//
//   lptest            correctness table (exit code 1 on any failure)
//   lptest --quick    a smaller set (for compute-sanitizer)
//   lptest --bench    timings of forward(+combine) and backward on the shapes of docs/design.md §6
//
// Inputs are fresh random numbers (hidden ~ N(0,1), weight ~ N(0,1)/sqrt(h)) drawn on the device;
// the reference is float64 on the CPU on the same rounded operands. Outputs are poisoned (NaN)
// before each run, and checked to be written. Bitwise checks: a repeated run, a subset of rows run
// as its own call (batch invariance), and a vocab shard run with its vocab_start (TP invariance).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>
#include <thread>
#include <vector>

#include "linear_logp_cuda.h"
#include "lp_internal.h"

using namespace rlk;

#define CK(x)                                                                                          \
  do {                                                                                                 \
    cudaError_t e_ = (x);                                                                              \
    if (e_ != cudaSuccess) {                                                                           \
      fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, __LINE__, #x); \
      exit(2);                                                                                         \
    }                                                                                                  \
  } while (0)
#define CKS(x)                                                             \
  do {                                                                     \
    Status s_ = (x);                                                       \
    if (s_) {                                                              \
      fprintf(stderr, "rlk error: %s at %s:%d\n", s_, __FILE__, __LINE__); \
      exit(2);                                                             \
    }                                                                      \
  } while (0)

// ---- device RNG fill ------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t hash32(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return uint32_t(x);
}
__device__ __forceinline__ float normal_at(uint64_t seed, uint64_t i) {
  const float u1 = (hash32(seed * 0x9E3779B97F4A7C15ULL + 2 * i) + 1.0f) * 2.3283064e-10f;
  const float u2 = hash32(seed * 0x9E3779B97F4A7C15ULL + 2 * i + 1) * 2.3283064e-10f;
  return sqrtf(-2.f * logf(u1)) * cospif(2.f * u2);
}
template <typename T> __device__ T cvt(float x);
template <> __device__ float cvt<float>(float x) { return x; }
template <> __device__ __half cvt<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __nv_bfloat16 cvt<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <typename T>
__global__ void fill_normal(T* p, int64_t n, uint64_t seed, float scale, float shift) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = cvt<T>(normal_at(seed, i) * scale + shift);
}
__global__ void fill_uniform_f32(float* p, int64_t n, uint64_t seed, float lo, float hi) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = lo + (hi - lo) * (hash32(seed * 31 + i) * 2.3283064e-10f);
}

// A fingerprint of a buffer's bits (order-free sum of a mix of each 2-byte word with its index; every
// output is a whole number of 2-byte words): bench prints the outputs' fingerprints, so that an A/B
// of two builds shows whether the bits moved.
__global__ void fingerprint_kernel(const uint16_t* p, int64_t n, unsigned long long* out) {
  unsigned long long h = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint64_t x = (uint64_t(i) << 32 | p[i]) * 0x9E3779B97F4A7C15ULL;
    x ^= x >> 31;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 29;
    h += x;
  }
  atomicAdd(out, h);
}

static void dev_fill(DType dt, void* p, int64_t n, uint64_t seed, float scale, float shift = 0.f) {
  if (n == 0) return;
  switch (dt) {
    case DType::kF32: fill_normal<float><<<1024, 256>>>((float*)p, n, seed, scale, shift); break;
    case DType::kF16: fill_normal<__half><<<1024, 256>>>((__half*)p, n, seed, scale, shift); break;
    case DType::kBF16: fill_normal<__nv_bfloat16><<<1024, 256>>>((__nv_bfloat16*)p, n, seed, scale, shift); break;
  }
  CK(cudaGetLastError());
}

static float h2f(DType dt, const void* p, int64_t i) {
  if (dt == DType::kF32) return ((const float*)p)[i];
  uint16_t b = ((const uint16_t*)p)[i];
  if (dt == DType::kBF16) {
    uint32_t u = uint32_t(b) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
  }
  __half_raw r;
  r.x = b;
  return __half2float(__half(r));
}

static const char* dname(DType d) { return d == DType::kF32 ? "f32" : d == DType::kF16 ? "f16" : "bf16"; }

template <typename F> static void par_for(int64_t n, F f) {
  int nt = std::max(1u, std::thread::hardware_concurrency());
  nt = int(std::min<int64_t>(nt, std::max<int64_t>(n, 1)));
  std::vector<std::thread> th;
  for (int t = 0; t < nt; ++t)
    th.emplace_back([&, t] {
      for (int64_t i = t; i < n; i += nt) f(i);
    });
  for (auto& x : th) x.join();
}

struct DevBuf {
  void* p = nullptr;
  size_t bytes = 0;
  explicit DevBuf(size_t b = 0) : bytes(b) {
    if (b) CK(cudaMalloc(&p, b));
  }
  ~DevBuf() {
    if (p) cudaFree(p);
  }
  DevBuf(const DevBuf&) = delete;
  template <typename T> T* as() const { return (T*)p; }
  void poison() {
    if (bytes) CK(cudaMemset(p, 0xFF, bytes));
  }  // all-ones bytes: NaN in f32/f16/bf16
  template <typename T> std::vector<T> get(size_t count) const {
    std::vector<T> v(count);
    if (count) CK(cudaMemcpy(v.data(), p, count * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
  }
};

// One fingerprint of several buffers (the sum of theirs).
static unsigned long long fingerprint(std::initializer_list<const DevBuf*> bufs) {
  DevBuf h(8);
  CK(cudaMemset(h.p, 0, 8));
  for (const DevBuf* b : bufs)
    fingerprint_kernel<<<1024, 256>>>(b->as<uint16_t>(), int64_t(b->bytes / 2), h.as<unsigned long long>());
  CK(cudaGetLastError());
  return h.get<unsigned long long>(1)[0];
}

// ---- one run of forward + combine (+ backward) ---------------------------------------------------
struct Inputs {
  Problem p;
  const void* hidden;
  const void* weight;
  const float* bias;
  const int32_t* targets;
  const float* temperature;
  const float* g;
  const float* e;
};
struct Outputs {
  std::vector<float> stats, tlogit, logp, lse, ent, dh, db, dzz;
  std::vector<uint16_t> dw16;
  std::vector<float> dw32;
  Backend fwd_be = Backend::kCount;
  bool saved_written = true;  // fast: every byte of the saved record written (the poison is NaN)
};

// fast: the forward keeps the logits and the backward reads (and overwrites) them. dh_dtype: f32
// (a vocab shard's partial, as the frontends ask under TP) or the operand dtype (the whole vocab).
static Outputs run_once(const Inputs& in, bool bwd, bool fast, DType dh_dtype) {
  const Problem& p = in.p;
  Outputs o;
  const int64_t K = num_chunks(p);
  DevBuf stats(size_t(p.n) * K * kStatWidth * 4), tl(p.n * 4), logp(p.n * 4), m(p.n * 4), log_s(p.n * 4), ent(p.n * 4);
  DevBuf fws(cuda::forward_workspace_bytes(p));
  stats.poison();
  tl.poison();
  logp.poison();
  m.poison();
  log_s.poison();
  ent.poison();
  fws.poison();
  DevBuf saved(bwd && fast ? cuda::saved_logits_bytes(p) : 0);
  saved.poison();
  OperandArgs ops;  // the forward's and the backward's
  ops.hidden = in.hidden;
  ops.weight = in.weight;
  ops.bias = in.bias;
  ops.targets = in.targets;
  ops.temperature = in.temperature;
  FwdArgs fa;
  static_cast<OperandArgs&>(fa) = ops;
  fa.stats = stats.as<float>();
  fa.target_logit = tl.as<float>();
  fa.saved_logits = saved.p;
  CKS(cuda::forward(p, fa, {fws.p, fws.bytes}, 0, &o.fwd_be));
  if (saved.p) {  // z or the head: fp32, never NaN here; q: fp16 in [0, 1]
    const size_t f32 = p.dtype == DType::kF32 ? saved.bytes / 4 : size_t(p.n) * cuda::SavedLayout(p).floats;
    const std::vector<float> z = saved.get<float>(f32);
    for (float x : z) o.saved_written &= !std::isnan(x);
    if (p.dtype != DType::kF32) {
      std::vector<uint16_t> q(size_t(p.n) * p.v);
      CK(cudaMemcpy(q.data(), static_cast<char*>(saved.p) + f32 * 4, q.size() * 2, cudaMemcpyDeviceToHost));
      for (uint16_t x : q) o.saved_written &= x <= 0x3c00;
    }
  }
  CombineArgs ca;
  ca.n = p.n;
  ca.k = K;
  ca.real_vocab = p.real_vocab;
  ca.ignore_index = p.ignore_index;
  ca.stats = stats.as<float>();
  ca.target_logit = tl.as<float>();
  ca.targets = in.targets;
  ca.logp = logp.as<float>();
  ca.m = m.as<float>();
  ca.log_s = log_s.as<float>();
  ca.entropy = ent.as<float>();
  CKS(cuda::combine(ca, 0));
  CK(cudaDeviceSynchronize());
  o.stats = stats.get<float>(p.n * K * kStatWidth);
  o.tlogit = tl.get<float>(p.n);
  o.logp = logp.get<float>(p.n);
  o.ent = ent.get<float>(p.n);
  o.lse = m.get<float>(p.n);
  const std::vector<float> ls = log_s.get<float>(p.n);
  for (int64_t i = 0; i < p.n; ++i) o.lse[i] += ls[i];
  if (!bwd) return o;
  DevBuf dh(size_t(p.n) * p.h * dtype_bytes(dh_dtype)), dw(size_t(p.v) * p.h * dtype_bytes(p.dtype)), db(p.v * 4),
      dzz(p.n * 4);
  DevBuf bws(cuda::backward_workspace_bytes(p, fast, dh_dtype));
  dh.poison();
  dw.poison();
  db.poison();
  dzz.poison();
  bws.poison();
  BwdArgs ba;
  static_cast<OperandArgs&>(ba) = ops;
  ba.m = m.as<float>();
  ba.log_s = log_s.as<float>();
  ba.entropy = p.with_entropy ? ent.as<float>() : nullptr;
  ba.g = in.g;
  ba.e = p.with_entropy ? in.e : nullptr;
  ba.dhidden = dh.p;
  ba.dhidden_dtype = dh_dtype;
  ba.dweight = dw.p;
  ba.dbias = p.has_bias ? db.as<float>() : nullptr;
  ba.dtemp = dzz.as<float>();
  ba.saved_logits = saved.p;
  CKS(cuda::backward(p, ba, {bws.p, bws.bytes}, 0));
  CK(cudaDeviceSynchronize());
  if (dh_dtype == DType::kF32) o.dh = dh.get<float>(size_t(p.n) * p.h);
  else {
    const std::vector<uint16_t> raw = dh.get<uint16_t>(size_t(p.n) * p.h);
    o.dh.resize(raw.size());
    for (size_t i = 0; i < raw.size(); ++i) o.dh[i] = h2f(dh_dtype, raw.data(), i);
  }
  if (p.dtype == DType::kF32) o.dw32 = dw.get<float>(size_t(p.v) * p.h);
  else o.dw16 = dw.get<uint16_t>(size_t(p.v) * p.h);
  if (p.has_bias) o.db = db.get<float>(p.v);
  o.dzz = dzz.get<float>(p.n);
  return o;
}

static const char* backend_name_local(Backend b) {
  return b == Backend::kCudaSm90 ? "sm90" : b == Backend::kCudaPortable ? "portable" : b == Backend::kCpu ? "cpu" : "?";
}

template <typename T> static bool same_bits(const T* a, const T* b, size_t n) {
  return n == 0 || memcmp(a, b, n * sizeof(T)) == 0;
}

// ---- the table ---------------------------------------------------------------------------------
struct Row {
  std::string name;
  double e_logp, e_ent, e_dh, e_dw, e_db, e_dzz;
  bool written, det, batch, batch_dh, tp, pass;
  std::string be;
};
static std::vector<Row> g_rows;

struct Case {
  int64_t n, h, v;
  DType dt;
  bool bias, entropy;
  int64_t pad;
  bool bwd = true;
  int64_t sub0 = -1, sub1 = -1;
  bool tp = false;
  bool portable = false;
  bool fast = false;  // the fast backward (saved logits) instead of the lean one
  bool misalign = false;  // hidden 2 bytes off 16-byte alignment: no TMA (portable forward, lean's gemm path)
};

static double relerr(const std::vector<double>& a, const std::vector<double>& r) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = a[i] - r[i];
    if (std::isnan(a[i])) return INFINITY;
    num += d * d;
    den += r[i] * r[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

static void run_case(const Case& c, uint64_t seed) {
  cuda::detail::set_sm90_enabled(!c.portable);
  Problem p;
  p.n = c.n;
  p.h = c.h;
  p.v = c.v;
  p.vocab_start = 0;
  p.real_vocab = c.v - c.pad;
  p.chunk = canonical_chunk(c.v);
  p.ignore_index = -100;
  p.dtype = c.dt;
  p.has_bias = c.bias;
  p.with_entropy = c.entropy;
  const size_t eb = dtype_bytes(c.dt);
  DevBuf Hbuf(size_t(c.n) * c.h * eb + 16), W(size_t(c.v) * c.h * eb), B(c.v * 4), T(c.n * 4), IT(c.n * 4), G(c.n * 4),
      E(c.n * 4);
  void* const hid = static_cast<char*>(Hbuf.p) + (c.misalign ? 2 : 0);
  dev_fill(c.dt, hid, c.n * c.h, seed + 1, 1.f);
  dev_fill(c.dt, W.p, c.v * c.h, seed + 2, 1.f / std::sqrt(double(c.h)));
  dev_fill(DType::kF32, B.p, c.v, seed + 3, 0.5f);
  // a frontend may mask columns through the (f32) bias: two -inf columns behave as padding
  const int64_t masked[2] = {5 % c.v, (c.v / 2 + 3) % c.v};
  if (c.bias)
    for (int64_t j : masked) {
      const float ninf = -INFINITY;
      CK(cudaMemcpy(B.as<float>() + j, &ninf, 4, cudaMemcpyHostToDevice));
    }
  fill_uniform_f32<<<256, 256>>>(IT.as<float>(), c.n, seed + 4, 0.5f, 2.0f);
  dev_fill(DType::kF32, G.p, c.n, seed + 5, 1.f);
  dev_fill(DType::kF32, E.p, c.n, seed + 6, 1.f);
  CK(cudaDeviceSynchronize());
  std::vector<int32_t> tg(c.n);
  srand(unsigned(seed));
  for (int64_t i = 0; i < c.n; ++i)
    tg[i] = (i % 7 == 3) ? -100 : int32_t(((uint64_t(rand()) << 16) ^ rand()) % p.real_vocab);
  if (c.n > 2) tg[1] = int32_t(p.real_vocab - 1);  // the last real id
  if (c.bias)
    for (auto& t : tg)
      if (t == masked[0] || t == masked[1]) t = int32_t((t + 1) % p.real_vocab);
  CK(cudaMemcpy(T.p, tg.data(), c.n * 4, cudaMemcpyHostToDevice));

  Inputs in{
      p, hid, W.p, c.bias ? B.as<float>() : nullptr, T.as<int32_t>(), IT.as<float>(), G.as<float>(), E.as<float>()};
  const DType dh_dtype = c.tp ? DType::kF32 : c.dt;  // as the frontends: f32 partials under TP
  Outputs o = run_once(in, c.bwd, c.fast, dh_dtype);

  // host copies of the rounded operands
  std::vector<float> hh(size_t(c.n) * c.h), ww(size_t(c.v) * c.h), bb(c.v, 0.f);
  {
    std::vector<uint8_t> raw(size_t(std::max(c.n, c.v)) * c.h * eb);
    CK(cudaMemcpy(raw.data(), hid, size_t(c.n) * c.h * eb, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < hh.size(); ++i) hh[i] = h2f(c.dt, raw.data(), i);
    CK(cudaMemcpy(raw.data(), W.p, size_t(c.v) * c.h * eb, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < ww.size(); ++i) ww[i] = h2f(c.dt, raw.data(), i);
    if (c.bias) CK(cudaMemcpy(bb.data(), B.p, c.v * 4, cudaMemcpyDeviceToHost));
  }
  std::vector<float> it = IT.get<float>(c.n), gg = G.get<float>(c.n), ee = E.get<float>(c.n);
  for (float& x : it) x = 1.f / x;  // IT holds temperatures; the kernels' reciprocal rounds the same

  // sampled rows and columns
  std::vector<int64_t> rows, cols;
  if (c.n <= 300)
    for (int64_t i = 0; i < c.n; ++i) rows.push_back(i);
  else {
    for (int64_t i = 0; i < 40; ++i) rows.push_back((i * 7919) % c.n);
    rows.push_back(c.n - 1);
    rows.push_back(1);
  }
  std::sort(rows.begin(), rows.end());
  rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
  const bool all_cols = double(c.n) * c.v * c.h < 4e9;
  if (all_cols)
    for (int64_t j = 0; j < c.v; ++j) cols.push_back(j);
  else {
    for (int64_t j = 0; j < 200; ++j) cols.push_back((j * 104729) % c.v);
    for (int64_t j = 0; j < 8; ++j) cols.push_back(c.v - 1 - j);
    for (int64_t k = 0; k < 16 && k < c.n; ++k)
      if (tg[k] >= 0) cols.push_back(tg[k]);
    std::sort(cols.begin(), cols.end());
    cols.erase(std::unique(cols.begin(), cols.end()), cols.end());
  }

  auto zval = [&](int64_t i, int64_t j) -> double {
    if (j >= p.real_vocab) return -INFINITY;
    double s = 0;
    const float* a = &hh[i * c.h];
    const float* w = &ww[j * c.h];
    for (int64_t k = 0; k < c.h; ++k) s += double(a[k]) * double(w[k]);
    return (s + bb[j]) * double(it[i]);
  };
  // forward reference on sampled rows (and dH, dzz from the full row)
  const size_t R = rows.size();
  std::vector<double> r_logp(R), r_ent(R), r_lse(R), d_logp(R), d_ent(R), r_dzz(R), d_dzz(R);
  std::vector<double> r_dh(c.bwd ? R * c.h : 0), d_dh(c.bwd ? R * c.h : 0);
  par_for(int64_t(R), [&](int64_t ri) {
    const int64_t i = rows[ri];
    std::vector<double> z(c.v);
    double m = -INFINITY;
    for (int64_t j = 0; j < c.v; ++j) {
      z[j] = zval(i, j);
      m = std::max(m, z[j]);
    }
    double s = 0, a = 0;
    for (int64_t j = 0; j < c.v; ++j)
      if (z[j] > -INFINITY) {
        double e = std::exp(z[j] - m);
        s += e;
        a += e * z[j];
      }
    const double lse = m + std::log(s), ent = lse - a / s;
    const bool valid = tg[i] != -100;
    r_lse[ri] = lse;
    r_logp[ri] = valid ? z[tg[i]] - lse : 0.0;
    r_ent[ri] = valid ? ent : 0.0;
    d_logp[ri] = o.logp[i];
    d_ent[ri] = c.entropy ? o.ent[i] : r_ent[ri];
    if (!c.bwd) return;
    double dzz = 0;
    std::vector<double> dh(c.h, 0.0);
    if (valid) {
      const double gi = gg[i], ei = c.entropy ? ee[i] : 0.0;
      for (int64_t j = 0; j < c.v; ++j) {
        if (!(z[j] > -INFINITY)) continue;
        const double pj = std::exp(z[j] - lse);
        const double dz = gi * ((j == tg[i] ? 1.0 : 0.0) - pj) + ei * pj * (lse - ent - z[j]);
        dzz += dz * z[j];
        const double dl = dz * it[i];
        const float* w = &ww[j * c.h];
        for (int64_t k = 0; k < c.h; ++k) dh[k] += dl * w[k];
      }
    }
    r_dzz[ri] = -dzz * it[i];
    d_dzz[ri] = o.dzz[i];  // dT = -inv_temp * sum dz z
    for (int64_t k = 0; k < c.h; ++k) {
      r_dh[ri * c.h + k] = dh[k];
      d_dh[ri * c.h + k] = o.dh[i * c.h + k];
    }
  });
  Row row;
  char nm[160];
  snprintf(nm, sizeof nm, "%-4s n=%-5lld h=%-4lld v=%-6lld%s%s%s pad=%lld", dname(c.dt), (long long)c.n, (long long)c.h,
           (long long)c.v, c.bias ? " bias" : "", c.entropy ? " ent" : "", c.misalign ? " unaligned" : "",
           (long long)c.pad);
  row.name = nm;
  row.be = std::string(backend_name_local(o.fwd_be)) + "/" + (c.bwd ? (c.fast ? "fast" : "lean") : "-") +
           (c.bwd ? (dh_dtype == DType::kF32 ? " dH32" : " dH16") : "");
  row.e_logp = relerr(d_logp, r_logp);
  row.e_ent = c.entropy ? relerr(d_ent, r_ent) : 0.0;
  row.e_dh = c.bwd ? relerr(d_dh, r_dh) : 0.0;
  row.e_dzz = c.bwd ? relerr(d_dzz, r_dzz) : 0.0;
  // dW / db on sampled columns (uses the device lse/entropy for rows outside the sample)
  row.e_dw = 0;
  row.e_db = 0;
  if (c.bwd) {
    std::vector<double> r_dw(cols.size() * c.h, 0.0), d_dw(cols.size() * c.h), r_db(cols.size(), 0.0),
        d_db(cols.size());
    par_for(int64_t(cols.size()), [&](int64_t ci) {
      const int64_t j = cols[ci];
      double dbj = 0;
      double* dw = &r_dw[ci * c.h];
      if (j < p.real_vocab) {
        for (int64_t i = 0; i < c.n; ++i) {
          if (tg[i] == -100) continue;
          const double z = zval(i, j), lse = o.lse[i], ent = c.entropy ? o.ent[i] : 0.0;
          if (!(z > -INFINITY)) continue;
          const double pj = std::exp(z - lse);
          const double dz = gg[i] * ((j == tg[i] ? 1.0 : 0.0) - pj) + (c.entropy ? ee[i] : 0.0) * pj * (lse - ent - z);
          const double dl = dz * it[i];
          dbj += dl;
          const float* a = &hh[i * c.h];
          for (int64_t k = 0; k < c.h; ++k) dw[k] += dl * a[k];
        }
      }
      r_db[ci] = dbj;
      if (c.bias) d_db[ci] = o.db[j];
      else d_db[ci] = dbj;
      for (int64_t k = 0; k < c.h; ++k)
        d_dw[ci * c.h + k] = c.dt == DType::kF32 ? o.dw32[j * c.h + k] : h2f(c.dt, o.dw16.data(), j * c.h + k);
    });
    row.e_dw = relerr(d_dw, r_dw);
    row.e_db = c.bias ? relerr(d_db, r_db) : 0.0;
  }
  // every output written (no NaN left from the poison; stats may hold -inf for padding chunks)
  bool wr = true;
  for (float x : o.stats) wr &= !std::isnan(x);
  for (int64_t i = 0; i < c.n; ++i)
    wr &= !std::isnan(o.tlogit[i]) && !std::isnan(o.logp[i]) && !std::isnan(o.lse[i]) && !std::isnan(o.ent[i]);
  if (c.bwd) {
    for (float x : o.dh) wr &= std::isfinite(x);
    for (float x : o.dzz) wr &= std::isfinite(x);
    for (float x : o.db) wr &= std::isfinite(x);
    for (float x : o.dw32) wr &= std::isfinite(x);
    for (size_t i = 0; i < o.dw16.size(); ++i) wr &= std::isfinite(h2f(c.dt, o.dw16.data(), i));
  }
  row.written = wr && o.saved_written;
  // determinism: a second run
  {
    Outputs o2 = run_once(in, c.bwd, c.fast, dh_dtype);
    bool d = same_bits(o.stats.data(), o2.stats.data(), o.stats.size()) &&
             same_bits(o.logp.data(), o2.logp.data(), o.logp.size()) &&
             same_bits(o.ent.data(), o2.ent.data(), o.ent.size()) &&
             same_bits(o.tlogit.data(), o2.tlogit.data(), o.tlogit.size());
    if (c.bwd)
      d = d && same_bits(o.dh.data(), o2.dh.data(), o.dh.size()) &&
          same_bits(o.dw16.data(), o2.dw16.data(), o.dw16.size()) &&
          same_bits(o.dw32.data(), o2.dw32.data(), o.dw32.size()) &&
          same_bits(o.db.data(), o2.db.data(), o.db.size()) && same_bits(o.dzz.data(), o2.dzz.data(), o.dzz.size());
    row.det = d;
  }
  // batch invariance: rows [sub0, sub1) as their own call
  row.batch = row.batch_dh = true;
  if (c.sub0 >= 0) {
    Inputs s = in;
    const int64_t a0 = c.sub0, m = c.sub1 - c.sub0, K = num_chunks(p);
    s.p.n = m;
    s.hidden = (const uint8_t*)in.hidden + a0 * c.h * eb;
    s.targets = in.targets + a0;
    s.temperature = in.temperature + a0;
    s.g = in.g + a0;
    s.e = in.e + a0;
    Outputs os = run_once(s, c.bwd, c.fast, dh_dtype);
    bool b = same_bits(os.stats.data(), o.stats.data() + a0 * K * kStatWidth, m * K * kStatWidth) &&
             same_bits(os.logp.data(), o.logp.data() + a0, m) && same_bits(os.ent.data(), o.ent.data() + a0, m);
    row.batch = b;
    // dH (a cuBLAS GEMM) and, in lean's gemm path, dzz (from z recomputed by one) may change with
    // n: the GEMM's algorithm is chosen per shape. Reported, not required.
    row.batch_dh = !c.bwd || (same_bits(os.dh.data(), o.dh.data() + a0 * c.h, m * c.h) &&
                              same_bits(os.dzz.data(), o.dzz.data() + a0, m));
  }
  // TP invariance: the second half of the vocab as a shard reproduces its chunks' stats
  row.tp = true;
  if (c.tp && num_chunks(p) % 2 == 0) {
    Inputs s = in;
    const int64_t half = c.v / 2, K = num_chunks(p);
    s.p.v = half;
    s.p.vocab_start = half;
    s.weight = (const uint8_t*)in.weight + half * c.h * eb;
    if (in.bias) s.bias = in.bias + half;
    Outputs os = run_once(s, false, false, DType::kF32);
    bool t = true;
    for (int64_t i = 0; i < c.n; ++i)
      t = t && same_bits(os.stats.data() + i * (K / 2) * kStatWidth, o.stats.data() + (i * K + K / 2) * kStatWidth,
                         (K / 2) * kStatWidth);
    row.tp = t;
  }
  const double tol_g = c.dt == DType::kF32 ? 1e-4 : 1e-2;
  row.pass = row.e_logp <= 2e-5 && row.e_ent <= 5e-5 && row.e_dh <= tol_g && row.e_dw <= tol_g && row.e_db <= tol_g &&
             row.e_dzz <= tol_g && row.written && row.det && row.batch && row.tp;
  g_rows.push_back(row);
  cuda::detail::set_sm90_enabled(true);
  printf("  done: %s  logp %.2e ent %.2e dH %.2e dW %.2e db %.2e dT %.2e %s\n", row.name.c_str(), row.e_logp, row.e_ent,
         row.e_dh, row.e_dw, row.e_db, row.e_dzz, row.pass ? "PASS" : "FAIL");
  fflush(stdout);
}

// ---- bench ---------------------------------------------------------------------------------------
static float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

static void bench_shape(const char* name, int64_t n, int64_t h, int64_t v, int reps, int warm = 3) {
  Problem p;
  p.n = n;
  p.h = h;
  p.v = v;
  p.real_vocab = v;
  p.chunk = canonical_chunk(v);
  p.dtype = DType::kBF16;
  p.has_bias = false;
  p.with_entropy = false;
  const int64_t K = num_chunks(p);
  DevBuf H(size_t(n) * h * 2), W(size_t(v) * h * 2), T(n * 4), IT(n * 4), G(n * 4);
  dev_fill(p.dtype, H.p, n * h, 11, 1.f);
  dev_fill(p.dtype, W.p, v * h, 12, 1.f / std::sqrt(double(h)));
  fill_uniform_f32<<<256, 256>>>(IT.as<float>(), n, 13, 1.f, 1.f);
  dev_fill(DType::kF32, G.p, n, 14, 1.f);
  std::vector<int32_t> tg(n);
  for (int64_t i = 0; i < n; ++i) tg[i] = int32_t((i * 2654435761ULL) % v);
  CK(cudaMemcpy(T.p, tg.data(), n * 4, cudaMemcpyHostToDevice));
  DevBuf stats(size_t(n) * K * 12), tl(n * 4), logp(n * 4), m(n * 4), log_s(n * 4), ent(n * 4),
      fws(cuda::forward_workspace_bytes(p));
  DevBuf dh(size_t(n) * h * 2), dw(size_t(v) * h * 2), dzz(n * 4);
  DevBuf lean_ws(cuda::backward_workspace_bytes(p, false, p.dtype)),
      fast_ws(cuda::backward_workspace_bytes(p, true, p.dtype));
  DevBuf saved(cuda::saved_logits_bytes(p));
  for (DevBuf* b : {&stats, &tl, &logp, &m, &log_s, &ent, &dh, &dw, &dzz, &saved})
    CK(cudaMemset(b->p, 0, b->bytes));  // fingerprinted
  OperandArgs ops;  // the forward's and the backward's
  ops.hidden = H.p;
  ops.weight = W.p;
  ops.targets = T.as<int32_t>();
  ops.temperature = IT.as<float>();
  FwdArgs fa;
  static_cast<OperandArgs&>(fa) = ops;
  fa.stats = stats.as<float>();
  fa.target_logit = tl.as<float>();
  CombineArgs ca;
  ca.n = n;
  ca.k = K;
  ca.real_vocab = v;
  ca.stats = stats.as<float>();
  ca.target_logit = tl.as<float>();
  ca.targets = T.as<int32_t>();
  ca.logp = logp.as<float>();
  ca.m = m.as<float>();
  ca.log_s = log_s.as<float>();
  ca.entropy = ent.as<float>();
  BwdArgs ba;
  static_cast<OperandArgs&>(ba) = ops;
  ba.m = m.as<float>();
  ba.log_s = log_s.as<float>();
  ba.g = G.as<float>();
  ba.dhidden = dh.p;
  ba.dhidden_dtype = p.dtype;
  ba.dweight = dw.p;
  ba.dtemp = dzz.as<float>();
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  Backend be = Backend::kCount;
  // one timed step: the forward (+ combine), keeping the logits or not, then optionally a backward
  auto step = [&](bool keep, int bwd /*0 none, 1 lean, 2 fast*/) {
    fa.saved_logits = keep ? saved.p : nullptr;
    ba.saved_logits = bwd == 2 ? saved.p : nullptr;
    CK(cudaEventRecord(e0));
    CKS(cuda::forward(p, fa, {fws.p, fws.bytes}, 0, &be));
    CKS(cuda::combine(ca, 0));
    if (bwd == 1) CKS(cuda::backward(p, ba, {lean_ws.p, lean_ws.bytes}, 0));
    if (bwd == 2) CKS(cuda::backward(p, ba, {fast_ws.p, fast_ws.bytes}, 0));
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    return ms;
  };
  auto timed = [&](bool keep, int bwd, int n_reps) {
    std::vector<float> t;
    for (int it = 0; it < n_reps + warm; ++it) {
      const float ms = step(keep, bwd);
      if (it >= warm) t.push_back(ms);
    }
    return median(t);
  };
  const int breps = warm == 0 ? 1 : std::max(3, reps / (n * h * double(v) > 4e12 ? 4 : 1));
  unsigned long long bits[4];  // the outputs of each timed step
  const float mf = timed(false, 0, reps);
  bits[0] = fingerprint({&stats, &tl, &logp, &m, &log_s});
  const float mk = timed(true, 0, reps);
  bits[1] = fingerprint({&saved});
  const float ml = timed(false, 1, breps);
  bits[2] = fingerprint({&dh, &dw, &dzz});
  const float mfa = timed(true, 2, breps);
  bits[3] = fingerprint({&dh, &dw, &dzz, &saved});
  const double flop = 2.0 * n * h * v;
  printf(
      "BENCH %-9s n=%-6lld h=%-5lld v=%-7lld fwd[%s] %8.3f ms (%5.0f TFLOP/s) fwd+keep %8.3f  fwd+bwd lean %9.3f ms  "
      "fast %9.3f ms  ws lean %zu MB fast %zu MB saved %zu MB\n",
      name, (long long)n, (long long)h, (long long)v, backend_name_local(be), mf, flop / mf * 1e-9, mk, ml, mfa,
      lean_ws.bytes >> 20, fast_ws.bytes >> 20, saved.bytes >> 20);
  printf("BENCH bits %-9s fwd %016llx keep %016llx lean %016llx fast %016llx\n", name, bits[0], bits[1], bits[2],
         bits[3]);
  fflush(stdout);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
}

int main(int argc, char** argv) {
  bool bench = false, quick = false, profile = false, tiny = false;
  std::string only;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--bench")) bench = true;
    else if (!strcmp(argv[i], "--quick")) quick = true;
    else if (!strcmp(argv[i], "--tiny")) tiny = true;
    else if (!strcmp(argv[i], "--profile")) {
      profile = true;
      bench = true;
    } else if (!strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  printf("device: %s (sm_%d%d)\n", prop.name, prop.major, prop.minor);
  if (bench) {
    struct S {
      const char* name;
      int64_t n, h, v;
    };
    const S shapes[] = {{"T1", 796, 2048, 75968},       {"T2", 1820, 2048, 75968},        {"T3", 6827, 2048, 75968},
                        {"T3-tp1", 6827, 2048, 151936}, {"H200-pub", 4096, 4096, 128256}, {"L16k", 16384, 4096, 151936},
                        {"L32k", 32768, 4096, 151936}};  // L32k: lean's dH in two row sweeps
    for (const S& s : shapes)
      if (only.empty() || only == s.name) bench_shape(s.name, s.n, s.h, s.v, profile ? 1 : 20, profile ? 0 : 3);
    return 0;
  }
  std::vector<Case> cases;
  const int64_t vodd = 7013;  // 1000*7+13: odd, so canonical_chunk(v) = v; no tile divides it
  auto add = [&](Case c) {  // every backward case runs with both strategies
    cases.push_back(c);
    if (c.bwd) {
      c.fast = true;
      cases.push_back(c);
    }
  };
  if (tiny) {  // for compute-sanitizer: every kernel, small and odd shapes
    add({127, 64, vodd, DType::kBF16, true, true, 13, true, 5, 68, false});
    add({127, 64, vodd, DType::kF32, true, true, 13, true, 5, 68, false});
    add({127, 64, vodd, DType::kBF16, true, true, 13, true, 5, 68, false, true});
    add({300, 128, 24576, DType::kF16, false, true, 7, true, -1, -1, true});
    add({300, 72, 1000, DType::kBF16, true, false, 3, true, -1, -1, false});
    add({3, 256, 1000, DType::kBF16, true, true, 0, true, -1, -1, false});  // odd chunk (125): odd tile starts
    add({300, 64, vodd, DType::kBF16, true, true, 13, true, -1, -1, false, false, false, true});  // unaligned hidden
  }
  if (!tiny) {
    for (DType dt : {DType::kBF16, DType::kF16, DType::kF32}) {
      add({127, 64, vodd, dt, true, true, 13, true, 5, 68, false});
      add({3, 2048, 151936, dt, false, true, 100, true, -1, -1, true});
    }
    add({1, 64, 151936, DType::kBF16, true, false, 0, true, -1, -1, true});
    add({127, 256, 1000, DType::kBF16, true, true, 0, true, 5, 68, true});  // odd chunk (125): odd tile starts
    add({127, 2048, vodd, DType::kBF16, false, true, 0, true, 5, 68, false});
    add({127, 2048, 151936, DType::kF16, true, true, 36, true, 5, 68, true});
    add({127, 64, vodd, DType::kBF16, true, true, 13, true, 5, 68, false, true});      // portable kernel forced
    add({127, 2048, 151936, DType::kF16, true, true, 36, true, 5, 68, true, true});
    add({300, 64, vodd, DType::kBF16, true, true, 13, true, 5, 68, false, false, false, true});  // unaligned hidden
    if (!quick) {
      add({4097, 64, vodd, DType::kF32, true, true, 5, true, 4000, 4097, false});
      add({4097, 2048, 151936, DType::kBF16, true, true, 36, true, 100, 300, true});
      add({4097, 64, 8192 * 3, DType::kBF16, false, false, 7, true, -1, -1, true});
      add({4097, 2048, 151936, DType::kBF16, true, true, 36, true, 100, 300, true, true});
      add({300, 72, 7013, DType::kBF16, true, true, 13, true, 5, 68, false});  // h % 64 != 0: portable
      add({16384, 256, 151936, DType::kBF16, false, true, 36, false, -1, -1, false});  // n*v > 2^31
      add({80000, 64, vodd, DType::kBF16, true, true, 13, true, -1, -1,
           false});  // lean: 8 row passes across dH's split
      add({16384, 2048, 151936, DType::kBF16, true, true, 36, true, -1, -1, false});  // lean: tiles borrowed from dW
      add({32768, 4096, 7013, DType::kBF16, true, true, 13, true, -1, -1, false});  // lean: dH in two row sweeps
      add({131072, 1024, 7013, DType::kBF16, true, true, 13, true, -1, -1,
           false});  // lean: sweeps of several row passes
    }
  }
  uint64_t seed = 1000;
  for (const Case& c : cases) run_case(c, seed += 17);
  printf("\n%-52s %-17s %9s %9s %9s %9s %9s %9s %5s %5s %5s %5s %5s  %s\n", "case", "fwd/bwd", "logp", "entropy", "dH",
         "dW", "db", "dT", "wrote", "det", "batch", "bgrad", "tp", "result");
  bool all = true;
  for (const Row& r : g_rows) {
    printf("%-52s %-17s %9.2e %9.2e %9.2e %9.2e %9.2e %9.2e %5s %5s %5s %5s %5s  %s\n", r.name.c_str(), r.be.c_str(),
           r.e_logp, r.e_ent, r.e_dh, r.e_dw, r.e_db, r.e_dzz, r.written ? "ok" : "NO", r.det ? "ok" : "NO",
           r.batch ? "ok" : "NO", r.batch_dh ? "ok" : "no", r.tp ? "ok" : "NO", r.pass ? "PASS" : "FAIL");
    all &= r.pass;
  }
  printf("%s (%zu cases)\n", all ? "ALL PASS" : "SOME FAILED", g_rows.size());
  return all ? 0 : 1;
}
