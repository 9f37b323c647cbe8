// Small SIMD vocabulary for the CPU backend: GCC/Clang vector extensions (AVX-512 registers when
// the target has them, pairs of AVX2 registers otherwise), dtype conversions, and an exp that the
// compiler can vectorize. Everything here is exact-order arithmetic: no reassociation, so results
// are the same bits on every run.
#pragma once

#include <cstdint>
#include <cstring>

#include "rlk/linear_logp.h"

namespace rlk::cpu {

constexpr int kLanes = 16;
typedef float f32x16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t i32x16 __attribute__((vector_size(64), aligned(4)));

inline f32x16 load16(const float* p) { f32x16 v; std::memcpy(&v, p, sizeof v); return v; }
inline void store16(float* p, f32x16 v) { std::memcpy(p, &v, sizeof v); }
inline f32x16 splat(float x) { return f32x16{} + x; }

// exp(x) in fp32 for a vector, about 2 ulp: x = n ln2 + r, |r| <= ln2/2, a degree-6 polynomial in
// r, then a scale by 2^n built in the exponent bits. Below -87 (and for -inf) it returns 0.
inline f32x16 vexp(f32x16 x) {
  const f32x16 lo = splat(-87.0f), hi = splat(88.0f);
  const f32x16 xc = x < lo ? lo : (x > hi ? hi : x);
  const f32x16 n = __builtin_convertvector(__builtin_convertvector(xc * 1.44269504088896341f + (xc < 0 ? -0.5f : 0.5f), i32x16), f32x16);
  const f32x16 r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;
  f32x16 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const i32x16 bits = (__builtin_convertvector(n, i32x16) + 127) << 23;
  f32x16 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  const f32x16 y = p * scale;
  return x < lo ? splat(0.f) : y;
}

// log(x) in fp32 for a vector of normal x > 0, a few ulp: x = 2^k y with y in [sqrt(1/2), sqrt(2)),
// log y = 2 atanh(u) = 2 (u + u^3/3 + ... + u^9/9) with u = (y - 1) / (y + 1), |u| <= 0.172.
inline f32x16 vlog(f32x16 x) {
  i32x16 bits;
  std::memcpy(&bits, &x, sizeof bits);
  i32x16 k = ((bits >> 23) & 0xff) - 127;
  i32x16 ybits = (bits & 0x007fffff) | 0x3f800000;  // y in [1, 2)
  f32x16 y;
  std::memcpy(&y, &ybits, sizeof y);
  const i32x16 big = y > 1.41421356f;
  y = big ? y * 0.5f : y;
  k = big ? k + 1 : k;
  const f32x16 u = (y - 1.f) / (y + 1.f), u2 = u * u;
  f32x16 s = splat(1.f / 9.f);
  s = s * u2 + 1.f / 7.f;
  s = s * u2 + 1.f / 5.f;
  s = s * u2 + 1.f / 3.f;
  s = s * u2 + 1.f;
  return 2.f * u * s + __builtin_convertvector(k, f32x16) * 0.693147180559945f;
}

inline f32x16 vmax(f32x16 a, f32x16 b) { return a > b ? a : b; }

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

}  // namespace rlk::cpu
