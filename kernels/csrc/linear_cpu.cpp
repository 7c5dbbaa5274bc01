// float32 linear layers for the CPU over weights packed once into panels of 16 output columns:
// packed[panel][k][16] = W[panel * 16 + j][k] (zero past the last column).
//
// Why our own: oneDNN's packed linear (mkldnn::_linear_pointwise) costs ~40 us per call before
// it multiplies anything (measured here at 64x64: 48 us against 7 us for MKL's sgemv on a
// plain weight), and a decode step of SmolLM2 at batch 1 calls it 121 times; MKL's sgemm on
// plain weights repacks them on every call instead, which costs as much as the multiply at
// decode batch sizes. One pass of this kernel streams each panel once, K-major and contiguous
// (what the hardware prefetcher wants at batch 1, where a step only reads the weights), and
// reuses it from L1/L2 for every group of rows (what batch 32 and prefill want).
//
// Each output element is one float32 sum over k in order 0..K-1, whatever the number of rows
// and however they are grouped, so a row's result does not depend on the batch it ran in.
//
// Vectors: AVX-512 intrinsics where the build targets it: a panel row in one vector of 16
// floats, two panels walked together, row groups of up to 12 rows (bench/results/xeon_amx/
// linear.json). Else AVX2 + FMA: 8 floats, up to 6 rows in 15 of its 16 registers (with
// -march=native on x86). Elsewhere a portable loop that the compiler vectorizes as it can.
// Every path sums each element by FMAs over k in order: the same bits.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "cpu_ops.h"
#include "linear_blocks.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define PAGEDGEN_LINEAR_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDGEN_LINEAR_AVX2 1
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>

namespace {

constexpr int64_t kPanel = pagedgen_cpu::kFloatPanelColumns;  // one vector of 16, or two of 8
#ifdef PAGEDGEN_LINEAR_AVX512
constexpr int64_t kMaxRows = 12;  // rows per group
constexpr int64_t kUnitPanels = 2;  // panels walked together (panel_pair_rows)
#else
constexpr int64_t kMaxRows = 6;
constexpr int64_t kUnitPanels = 1;
#endif

inline void finish_row(const float* sums, float* row, int64_t ncols, const float* bias) {
  if (bias != nullptr) {
    for (int64_t j = 0; j < ncols; ++j) row[j] = sums[j] + bias[j];
  } else {
    for (int64_t j = 0; j < ncols; ++j) row[j] = sums[j];
  }
}

// y[r][0..ncols) = x[r] . panel (+ bias) for R rows; ncols <= 16 (the last panel may be partial).
template <int R>
void panel_rows(const float* x, int64_t ldx, const float* panel, int64_t K, float* y,
                int64_t ldy, int64_t ncols, const float* bias) {
  alignas(64) float sums[R][kPanel];
#if defined(PAGEDGEN_LINEAR_AVX512)
  __m512 acc[R];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 w = _mm512_loadu_ps(panel + k * kPanel);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k]), w, acc[r]);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) _mm512_store_ps(sums[r], acc[r]);
#elif defined(PAGEDGEN_LINEAR_AVX2)
  __m256 acc0[R], acc1[R];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_loadu_ps(panel + k * kPanel);
    const __m256 w1 = _mm256_loadu_ps(panel + k * kPanel + 8);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 xs = _mm256_broadcast_ss(x + r * ldx + k);
      acc0[r] = _mm256_fmadd_ps(xs, w0, acc0[r]);
      acc1[r] = _mm256_fmadd_ps(xs, w1, acc1[r]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(sums[r], acc0[r]);
    _mm256_store_ps(sums[r] + 8, acc1[r]);
  }
#else
  for (int r = 0; r < R; ++r) {
    for (int64_t j = 0; j < kPanel; ++j) sums[r][j] = 0.0f;
  }
  for (int64_t k = 0; k < K; ++k) {
    const float* w = panel + k * kPanel;
    for (int r = 0; r < R; ++r) {
      const float xs = x[r * ldx + k];
      // std::fma, as the AVX2 path: the same rounding for every row count (a plain
      // multiply-add may or may not be contracted, and not alike in every unrolling).
#pragma omp simd
      for (int64_t j = 0; j < kPanel; ++j) sums[r][j] = std::fma(xs, w[j], sums[r][j]);
    }
  }
#endif
  for (int r = 0; r < R; ++r) finish_row(sums[r], y + r * ldy, ncols, bias);
}

#ifdef PAGEDGEN_LINEAR_AVX512
// Two adjacent panels at once (32 columns; ncols in 17..32): each broadcast of x feeds two
// FMAs, so a k step loads 2 + R values for 2R FMAs instead of 1 + R for R, which bound the
// one-panel walk by loads (2 threads of a Xeon with AVX-512, 256-2048 rows: 240-270 GFLOP/s,
// against 400 for MKL). 24 accumulators, 2 panel vectors and a broadcast of the 32 registers.
// Each element is still one FMA chain over k in order: the same bits as one panel at a time.
template <int R>
void panel_pair_rows(const float* x, int64_t ldx, const float* panel, const float* next_panel,
                     int64_t K, float* y, int64_t ldy, int64_t ncols, const float* bias) {
  alignas(64) float sums[R][2 * kPanel];
  __m512 acc0[R], acc1[R];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 w0 = _mm512_loadu_ps(panel + k * kPanel);
    const __m512 w1 = _mm512_loadu_ps(next_panel + k * kPanel);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512 xs = _mm512_set1_ps(x[r * ldx + k]);
      acc0[r] = _mm512_fmadd_ps(xs, w0, acc0[r]);
      acc1[r] = _mm512_fmadd_ps(xs, w1, acc1[r]);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    _mm512_store_ps(sums[r], acc0[r]);
    _mm512_store_ps(sums[r] + kPanel, acc1[r]);
  }
  for (int r = 0; r < R; ++r) finish_row(sums[r], y + r * ldy, ncols, bias);
}
#endif

void rows_of_panel(const float* x, int64_t ldx, int64_t rows, const float* panel, int64_t K,
                   float* y, int64_t ldy, int64_t ncols, const float* bias) {
#ifdef PAGEDGEN_LINEAR_AVX512
  if (ncols > kPanel) {  // this panel and the next (the caller's unit is a pair)
    pagedgen_cpu::for_each_row_group<kMaxRows>(rows, [&](auto group_rows, int64_t r) {
      panel_pair_rows<decltype(group_rows)::value>(x + r * ldx, ldx, panel, panel + K * kPanel,
                                                   K, y + r * ldy, ldy, ncols, bias);
    });
    return;
  }
#endif
  pagedgen_cpu::for_each_row_group<kMaxRows>(rows, [&](auto group_rows, int64_t r) {
    panel_rows<decltype(group_rows)::value>(x + r * ldx, ldx, panel, K, y + r * ldy, ldy, ncols,
                                            bias);
  });
}

}  // namespace

namespace pagedgen_cpu {

// W [N, K] float32 -> [ceil(N / 16), K, 16], zero-padded (bf16: pack_linear_weight_bf16).
at::Tensor pack_linear_weight(const at::Tensor& weight) {
  if (weight.scalar_type() == at::kBFloat16) return pack_linear_weight_bf16(weight);
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat,
              "weight must be a 2-d float32 or bfloat16 tensor [out_features, in_features]");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t panels = (N + kPanel - 1) / kPanel;
  auto packed = at::zeros({panels, K, kPanel}, weight.options());
  auto w = weight.contiguous();
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n) {
    float* column = dst + (n / kPanel) * K * kPanel + n % kPanel;
    const float* row = src + n * K;
    for (int64_t k = 0; k < K; ++k) column[k * kPanel] = row[k];
  }
  return packed;
}

// x [M, K] (rows may be strided), packed from pack_linear_weight -> [M, out_features].
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed,
                         const std::optional<at::Tensor>& bias, int64_t out_features) {
  if (x.scalar_type() == at::kBFloat16) return packed_linear_bf16(x, packed, bias, out_features);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat &&
                  (x.stride(1) == 1 || x.size(1) <= 1),
              "x must be float32 or bfloat16 [rows, in_features], contiguous in its last "
              "dimension");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous() &&
                  packed.scalar_type() == at::kFloat,
              "packed must come from pack_linear_weight");
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "x has ", K, " features, the weight ", packed.size(1));
  TORCH_CHECK(out_features > (panels - 1) * kPanel && out_features <= panels * kPanel,
              "out_features ", out_features, " does not match ", panels, " panels");
  const float* bias_ptr = nullptr;
  at::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    bias_c = bias->contiguous();
    TORCH_CHECK(bias_c.scalar_type() == at::kFloat && bias_c.numel() == out_features,
                "bias must be float32 [out_features]");
    bias_ptr = bias_c.data_ptr<float>();
  }
  auto y = at::empty({M, out_features}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Panels are handed out to the threads one by one, as many work items as panels (a 192-column
  // projection is 12 panels: 12 threads can stream it); each thread walks its range in units
  // of kUnitPanels adjacent panels, the last unit of a range with fewer where it runs short.
  for_each_row_block_and_panel_range(
      M, 4 * K, kMaxRows, panels, [&](int64_t m0, int64_t rows, int64_t begin, int64_t end) {
        for (int64_t p = begin; p < end; p += kUnitPanels) {
          const int64_t n0 = p * kPanel;
          const int64_t unit_panels = std::min(kUnitPanels, end - p);
          rows_of_panel(xp + m0 * ldx, ldx, rows, wp + p * K * kPanel, K,
                        yp + m0 * out_features + n0, out_features,
                        std::min(unit_panels * kPanel, out_features - n0),
                        bias_ptr == nullptr ? nullptr : bias_ptr + n0);
        }
      });
  return y;
}

}  // namespace pagedgen_cpu

TORCH_LIBRARY(pagedgen_cpu_linear, m) {
  m.def("pack_weight(Tensor weight) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  // Takes no tensor, so it has no dispatch key to register under: a catch-all kernel.
  m.def("bf16_native() -> bool", [] { return pagedgen_cpu::linear_bf16_native(); });
  m.def("bf16_amx() -> bool", [] { return pagedgen_cpu::linear_bf16_amx(); });
}

TORCH_LIBRARY_IMPL(pagedgen_cpu_linear, CPU, m) {
  m.impl("pack_weight", &pagedgen_cpu::pack_linear_weight);
  m.impl("linear", &pagedgen_cpu::packed_linear);
}
