// bfloat16 linear layers for the CPU on AVX512-BF16 (VDPBF16PS), over weights packed once into
// panels of 32 output columns and pairs of input features:
// packed[panel][k / 2][j][k % 2] = W[panel * 32 + j][k] (zero past the last column and, for an
// odd in_features, past the last feature).
//
// Why our own, as for float32 (linear_cpu.cpp): oneDNN's packed bf16 linear has the same fixed
// cost per call before it multiplies, and a batch-1 decode step of SmolLM2 calls 121 linears
// whose weights take ~8 ms to stream at this machine's read bandwidth; its batch-1 bf16 step
// was no faster than float32's. VDPBF16PS multiplies 16 pairs of bf16 into 16 float32 sums per
// instruction, so one panel row of 32 columns is two instructions per input-feature pair, and a
// row group of up to 12 rows reuses each panel load 12 times (batch 32, prefill).
//
// Sums are float32 over feature pairs in order (VDPBF16PS: each pair's two products added to
// the sum, denormal inputs and outputs read as zero, round to nearest even), then + bias in
// float32 and one rounding to bf16, whatever the number of rows and however they are grouped:
// a row's result does not depend on the batch it ran in.
//
// Built only where the compiler targets AVX512-BF16 (-march=native on such a CPU);
// bf16_native() says whether it was, and Python keeps oneDNN's bf16 linear elsewhere. On a
// CPU with AMX, packed_linear_bf16 hands every call to linear_bf16_amx.cpp instead (same
// packed weights, AMX tiles; bf16_amx() says whether it does).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>

#include "cpu_math.h"
#include "cpu_ops.h"
#include "linear_blocks.h"
#include "linear_bf16_store.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PAGEDGEN_LINEAR_BF16 1
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace {

constexpr int64_t kPanel = pagedgen_cpu::kBf16PanelColumns;  // 32 columns: two vectors of 16
constexpr int64_t kPanelRow = 2 * kPanel;  // bf16 values per feature pair in a panel

#ifdef PAGEDGEN_LINEAR_BF16
constexpr int64_t kMaxRows = 12;  // 24 accumulators + 2 panel vectors + a broadcast of 32 zmm

// The pair (x[k], x[k + 1]) as one 32-bit lane, x[k] in the low half (VDPBF16PS's order).
inline int32_t feature_pair(const uint16_t* x, int64_t k) {
  int32_t pair;
  std::memcpy(&pair, x + k, sizeof(pair));
  return pair;
}

// y[r][0..ncols) = x[r] . panel (+ bias) for R rows; ncols <= 32 (the last panel may be partial).
template <int R>
void panel_rows(const uint16_t* x, int64_t ldx, const uint16_t* panel, int64_t K, uint16_t* y,
                int64_t ldy, int64_t ncols, const float* bias) {
  __m512 acc0[R], acc1[R];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  const int64_t full_pairs = K / 2;
  for (int64_t kk = 0; kk < full_pairs; ++kk) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + kk * kPanelRow);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + kk * kPanelRow + kPanel);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512bh xs = (__m512bh)_mm512_set1_epi32(feature_pair(x + r * ldx, 2 * kk));
      acc0[r] = _mm512_dpbf16_ps(acc0[r], xs, w0);
      acc1[r] = _mm512_dpbf16_ps(acc1[r], xs, w1);
    }
  }
  if (K % 2 == 1) {  // the last feature alone: its pair's second half is zero on both sides
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + full_pairs * kPanelRow);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + full_pairs * kPanelRow + kPanel);
    for (int r = 0; r < R; ++r) {
      const __m512bh xs = (__m512bh)_mm512_set1_epi32(x[r * ldx + K - 1]);
      acc0[r] = _mm512_dpbf16_ps(acc0[r], xs, w0);
      acc1[r] = _mm512_dpbf16_ps(acc1[r], xs, w1);
    }
  }
  __m512 bias0 = _mm512_setzero_ps(), bias1 = _mm512_setzero_ps();
  alignas(64) float partial_bias[kPanel] = {};
  if (bias != nullptr) {
    std::memcpy(partial_bias, bias, ncols * sizeof(float));
    bias0 = _mm512_load_ps(partial_bias);
    bias1 = _mm512_load_ps(partial_bias + 16);
  }
  for (int r = 0; r < R; ++r) {
    pagedgen_cpu::store_bf16_panel_row(acc0[r], acc1[r], bias0, bias1, y + r * ldy, ncols);
  }
}

void rows_of_panel(const uint16_t* x, int64_t ldx, int64_t rows, const uint16_t* panel,
                   int64_t K, uint16_t* y, int64_t ldy, int64_t ncols, const float* bias) {
  pagedgen_cpu::for_each_row_group<kMaxRows>(rows, [&](auto group_rows, int64_t r) {
    panel_rows<decltype(group_rows)::value>(x + r * ldx, ldx, panel, K, y + r * ldy, ldy, ncols,
                                            bias);
  });
}
#endif  // PAGEDGEN_LINEAR_BF16

}  // namespace

namespace pagedgen_cpu {

bool linear_bf16_native() {
#ifdef PAGEDGEN_LINEAR_BF16
  return true;
#else
  return false;
#endif
}

// W [N, K] bf16 -> [ceil(N / 32), ceil(K / 2), 64], zero-padded.
at::Tensor pack_linear_weight_bf16(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "weight must be a 2-d bfloat16 tensor [out_features, in_features]");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t panels = (N + kPanel - 1) / kPanel, pairs = (K + 1) / 2;
  auto packed = at::zeros({panels, pairs, kPanelRow}, weight.options());
  auto w = weight.contiguous();
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  for (int64_t n = 0; n < N; ++n) {
    uint16_t* column = dst + (n / kPanel) * pairs * kPanelRow + 2 * (n % kPanel);
    const uint16_t* row = src + n * K;
    for (int64_t k = 0; k < K; ++k) column[(k / 2) * kPanelRow + k % 2] = row[k];
  }
  return packed;
}

// x [M, K] bf16 (rows may be strided), packed from pack_linear_weight_bf16 -> [M, out_features].
at::Tensor packed_linear_bf16(const at::Tensor& x, const at::Tensor& packed,
                              const std::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(linear_bf16_native(),
              "the bfloat16 linear needs AVX512-BF16, which this build does not target");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 &&
                  (x.stride(1) == 1 || x.size(1) <= 1),
              "x must be bfloat16 [rows, in_features], contiguous in its last dimension");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanelRow && packed.is_contiguous() &&
                  packed.scalar_type() == at::kBFloat16,
              "packed must come from pack_weight on a bfloat16 weight");
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0);
  TORCH_CHECK(packed.size(1) == (K + 1) / 2, "x has ", K, " features, the weight ",
              packed.size(1), " feature pairs");
  TORCH_CHECK(out_features > (panels - 1) * kPanel && out_features <= panels * kPanel,
              "out_features ", out_features, " does not match ", panels, " panels");
  at::Tensor bias_f;
  const float* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == out_features, "bias must have out_features (", out_features,
                ") values, got ", bias->numel());
    TORCH_CHECK(bias->scalar_type() == at::kFloat || bias->scalar_type() == at::kBFloat16,
                "bias must be float32 or bfloat16, got ", bias->scalar_type());
    bias_f = bias->to(at::kFloat).contiguous();  // (no copy for PackedLinear's float32 bias)
    bias_ptr = bias_f.data_ptr<float>();
  }
  auto y = at::empty({M, out_features}, x.options());
#ifdef PAGEDGEN_LINEAR_BF16
  if (M == 0) return y;
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const int64_t ldx = x.stride(0);
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  if (linear_bf16_amx()) {  // AMX tiles where the CPU has them (linear_bf16_amx.cpp)
    packed_linear_bf16_amx(xp, ldx, M, K, wp, panels, yp, out_features, bias_ptr);
    return y;
  }
  const int64_t panel_size = packed.size(1) * kPanelRow;
  for_each_row_block_and_panel(M, 2 * K, kMaxRows, panels,
                               [&](int64_t m0, int64_t rows, int64_t p) {
    const int64_t n0 = p * kPanel;
    rows_of_panel(xp + m0 * ldx, ldx, rows, wp + p * panel_size, K, yp + m0 * out_features + n0,
                  out_features, std::min(kPanel, out_features - n0),
                  bias_ptr == nullptr ? nullptr : bias_ptr + n0);
  });
#endif
  return y;
}

}  // namespace pagedgen_cpu
