// Small SIMD vocabulary for the CPU backend: GCC/Clang vector extensions one register wide (16 fp32
// lanes on AVX-512, 8 on AVX2: a wider vector has no register type there and GCC lowers it through
// the stack), dtype conversions, and an exp that the compiler can vectorize. Everything here is
// exact-order arithmetic: no reassociation, so results are the same bits on every run.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include "rlk/linear_logp.h"

namespace rlk::cpu::RLK_CPU_ISA {  // one namespace per ISA level (cpu/dispatch.h)

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float fvec __attribute__((vector_size(kLanes * 4), aligned(4)));
typedef int32_t ivec __attribute__((vector_size(kLanes * 4), aligned(4)));

// Unaligned loads and stores through a may_alias type: one vmovups (a memcpy into a local vector
// can go through a stack copy in 16-byte pieces).
typedef float fvec_mem __attribute__((vector_size(kLanes * 4), aligned(4), may_alias));
inline fvec vload(const float* p) { return *reinterpret_cast<const fvec_mem*>(p); }
inline void vstore(float* p, fvec v) { *reinterpret_cast<fvec_mem*>(p) = v; }
inline fvec splat(float x) { return fvec{} + x; }
inline fvec broadcast(float x) {  // x in every lane (splat's add turns -0 into +0)
#if defined(__AVX512F__)
  return _mm512_set1_ps(x);
#elif defined(__AVX__)
  return _mm256_set1_ps(x);
#else
  fvec v;
  for (int l = 0; l < kLanes; ++l) v[l] = x;
  return v;
#endif
}

// a * b + c rounded once, always one FMA instruction: -ffp-contract=fast leaves the contraction to
// the compiler's tuning (GCC's znver tunings split loop-carried FMA chains of up to 256 bits into
// a multiply and an add), and the GEMMs' chains must be FMAs for their bits to match target_dot.
inline fvec vfma(fvec a, fvec b, fvec c) {
#if defined(__AVX512F__)
  return _mm512_fmadd_ps(a, b, c);
#elif defined(__FMA__)
  return _mm256_fmadd_ps(a, b, c);
#else  // no FMA instruction: a correctly rounded fma per lane
  for (int l = 0; l < kLanes; ++l) c[l] = __builtin_fmaf(a[l], b[l], c[l]);
  return c;
#endif
}

// exp(x) in fp32 for a vector, about 2 ulp: x = n ln2 + r, |r| <= ln2/2, a degree-6 polynomial in
// r, then a scale by 2^n built in the exponent bits. Below -87 (and for -inf) it returns 0.
inline fvec vexp(fvec x) {
  const fvec lo = splat(-87.0f), hi = splat(88.0f);
  const fvec xc = x < lo ? lo : (x > hi ? hi : x);
  const fvec n =
      __builtin_convertvector(__builtin_convertvector(xc * 1.44269504088896341f + (xc < 0 ? -0.5f : 0.5f), ivec), fvec);
  const fvec r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;
  fvec p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const ivec bits = (__builtin_convertvector(n, ivec) + 127) << 23;
  fvec scale;
  std::memcpy(&scale, &bits, sizeof scale);
  const fvec y = p * scale;
  return x < lo ? splat(0.f) : y;
}

// log(x) in fp32 for a vector of normal x > 0, a few ulp: x = 2^k y with y in [sqrt(1/2), sqrt(2)),
// log y = 2 atanh(u) = 2 (u + u^3/3 + ... + u^9/9) with u = (y - 1) / (y + 1), |u| <= 0.172.
inline fvec vlog(fvec x) {
  ivec bits;
  std::memcpy(&bits, &x, sizeof bits);
  ivec k = ((bits >> 23) & 0xff) - 127;
  ivec ybits = (bits & 0x007fffff) | 0x3f800000;  // y in [1, 2)
  fvec y;
  std::memcpy(&y, &ybits, sizeof y);
  const ivec big = y > 1.41421356f;
  y = big ? y * 0.5f : y;
  k = big ? k + 1 : k;
  const fvec u = (y - 1.f) / (y + 1.f), u2 = u * u;
  fvec s = splat(1.f / 9.f);
  s = s * u2 + 1.f / 7.f;
  s = s * u2 + 1.f / 5.f;
  s = s * u2 + 1.f / 3.f;
  s = s * u2 + 1.f;
  return 2.f * u * s + __builtin_convertvector(k, fvec) * 0.693147180559945f;
}

inline fvec vmax(fvec a, fvec b) { return a > b ? a : b; }

// ---- dtype conversion ------------------------------------------------------------------------
inline float bf16_to_f32(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t f32_to_bf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
inline float f16_to_f32(uint16_t h) {
  _Float16 x;
  std::memcpy(&x, &h, 2);
  return float(x);
}
inline uint16_t f32_to_f16(float f) {
  _Float16 x = _Float16(f);
  uint16_t h;
  std::memcpy(&h, &x, 2);
  return h;
}

// Convert `count` elements of dtype `t` starting at element `offset` of `src` into fp32.
inline void to_f32(DType t, const void* src, int64_t offset, int64_t count, float* dst) {
  if (t == DType::kF32) {
    std::memcpy(dst, static_cast<const float*>(src) + offset, size_t(count) * 4);
  } else if (t == DType::kBF16) {
    const uint16_t* s = static_cast<const uint16_t*>(src) + offset;
    for (int64_t i = 0; i < count; ++i) dst[i] = bf16_to_f32(s[i]);
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(src) + offset;
    for (int64_t i = 0; i < count; ++i) dst[i] = f16_to_f32(s[i]);
  }
}

inline void from_f32(DType t, const float* src, int64_t count, void* dst, int64_t offset) {
  if (t == DType::kF32) {
    std::memcpy(static_cast<float*>(dst) + offset, src, size_t(count) * 4);
  } else if (t == DType::kBF16) {
    uint16_t* d = static_cast<uint16_t*>(dst) + offset;
    for (int64_t i = 0; i < count; ++i) d[i] = f32_to_bf16(src[i]);
  } else {
    uint16_t* d = static_cast<uint16_t*>(dst) + offset;
    for (int64_t i = 0; i < count; ++i) d[i] = f32_to_f16(src[i]);
  }
}

}  // namespace rlk::cpu::RLK_CPU_ISA
