// The last step of both bf16 linears (linear_bf16_cpu.cpp, linear_bf16_amx.cpp): one output
// row of a 32-column panel, its float32 sums plus bias rounded once to bf16.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace pagedgen_cpu {

// row[0..ncols) = bf16(sums + bias), columns 0-15 in the first vectors, 16-31 in the second.
// cvtneps: round to nearest even as from_float<BFloat16>, except that a subnormal sum becomes
// zero and a NaN keeps its sign and payload (quieted) where c10 gives 0x7fc0.
inline void store_bf16_panel_row(__m512 sums0, __m512 sums1, __m512 bias0, __m512 bias1,
                                 uint16_t* row, int64_t ncols) {
  const __m256bh lo = _mm512_cvtneps_pbh(_mm512_add_ps(sums0, bias0));
  const __m256bh hi = _mm512_cvtneps_pbh(_mm512_add_ps(sums1, bias1));
  if (ncols == 32) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(row), (__m256i)lo);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + 16), (__m256i)hi);
  } else {  // the last panel's columns only
    alignas(64) uint16_t staged[32];
    _mm256_store_si256(reinterpret_cast<__m256i*>(staged), (__m256i)lo);
    _mm256_store_si256(reinterpret_cast<__m256i*>(staged + 16), (__m256i)hi);
    std::memcpy(row, staged, ncols * sizeof(uint16_t));
  }
}

}  // namespace pagedgen_cpu
#endif
