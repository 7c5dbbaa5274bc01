// Float math the CPU kernels share, written so loops over it vectorize (-O3 -march=native and
// `omp simd`): libm's expf and c10's per-element bf16 conversions are scalar calls that kept
// whole loops scalar.
#pragma once

#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace pagedgen_cpu {

// Conversions between float and T. bf16 gets its own, in bit operations: c10::BFloat16's
// NaN test and rounding are per element (silu_mul of one bf16 row took 19 us against torch's
// 13 through them, of 32 rows 263 against 45). Same results: round to nearest even, any NaN
// to the quiet NaN 0x7fc0.
template <typename T>
inline float to_float(T x) {
  return static_cast<float>(x);
}

template <>
inline float to_float(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

template <typename T>
inline T from_float(float x) {
  return static_cast<T>(x);
}

template <>
inline c10::BFloat16 from_float(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
  return c10::BFloat16(static_cast<uint16_t>(nan ? 0x7fc0u : rounded),
                       c10::BFloat16::from_bits());
}

// exp(x) for x <= 0 (scores minus their running max), in a form the compiler vectorizes:
// libm's expf is a scalar call, and it was most of the kernel's time. 2^n * p(r) with
// x = n ln2 + r, |r| <= ln2/2, p the degree-6 Taylor polynomial: relative error < 2e-7.
inline float exp_nonpositive(float x) {
  const bool underflows = x < -87.f;  // e^x below float32's normal range: 0 (and -inf gives 0)
  x = underflows ? -87.f : x;
  // Round to nearest by the 1.5 * 2^23 trick: roundf is a libm call that blocks vectorizing.
  const float n = (x * 1.44269504f + 12582912.f) - 12582912.f;
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  int32_t bits;
  __builtin_memcpy(&bits, &p, sizeof bits);
  bits += static_cast<int32_t>(n) << 23;
  __builtin_memcpy(&p, &bits, sizeof p);
  return underflows ? 0.f : p;
}

// e^x for any x, for silu_mul (which must match torch's x / (1 + e^-x) to an ulp of bf16/fp16):
// Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2, then Cephes' expf polynomial (within 2 ulp,
// as torch's own vectorized exp), times 2^n built in the exponent bits as 2^(n-1) * 2 so that
// n = 128 still overflows to inf. Past ln(FLT_MAX) it is inf, as expf's; below -86.6 it stays
// at e^-86.6 (~2.5e-38, where 2^(n-1) would leave the normal range). NaN stays NaN. (The
// attention kernel keeps exp_nonpositive: cheaper, and its scores are never positive.)
inline float exp_approx(float x) {
  constexpr float kHi = 88.7228391f, kLo = -86.6f;
  x = x > kHi ? kHi : x;  // (comparisons, not min/max: they keep a NaN)
  x = x < kLo ? kLo : x;
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) - 1 + 127) << 23;
  float half_scale;
  std::memcpy(&half_scale, &bits, sizeof(half_scale));
  return p * half_scale * 2.f;
}

}  // namespace pagedgen_cpu
