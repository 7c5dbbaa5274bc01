// The bfloat16 linear on AMX tiles (Sapphire Rapids and later), over the same packed weights
// as linear_bf16_cpu.cpp: packed[panel][k / 2][j][k % 2] = W[panel * 32 + j][k].
//
// Why: VDPBF16PS tops out near 235 GFLOP/s on two Sapphire Rapids cores, and AMX's
// TDPBF16PS multiplies a 16 x 32 by a 32 x 16 tile per instruction: oneDNN's AMX linear ran
// 4-5x faster than our VDPBF16PS kernel from 32 rows up (bench.linear --dtype bfloat16 on a
// Xeon with AMX, 2 threads). But oneDNN pays a fixed cost per call (1 row: 21 us against our
// 12 for 576 x 960) and its results depend on the row count, and a bf16 engine on oneDNN's
// linears loses the decoder layers in one C++ call (decoder_cpu.cpp needs our linears). This
// path keeps all three: one AMX walk for every row count, called from the fused decoder.
//
// The packed layout is already AMX's B-tile layout: one k-pair row of a panel is 32 columns x
// 2 bf16, so the B tile of columns 0-15 (or 16-31) of 16 k-pairs is 16 rows of 64 bytes at a
// stride of 128 bytes. Tiles: C 0-3 (two 16-row halves x two 16-column halves of a panel),
// A 4-5 (the two row halves), B 6-7 (the two column halves).
//
// Sums: float32 over 32-feature chunks in order (TDPBF16PS), then the features past the last
// whole chunk pair by pair (VDPBF16PS), then + bias and one rounding to bf16. A row's sums
// never mix with another row's, and the chunk order does not depend on the row count, the
// row grouping or the threads: a row's result is the same in every batch, as with the
// VDPBF16PS kernel (which gives other last bits: a process uses one of the two throughout).

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include "cpu_ops.h"
#include "linear_blocks.h"
#include "linear_bf16_store.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define PAGEDGEN_LINEAR_AMX 1
#endif

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

namespace pagedgen_cpu {

#ifdef PAGEDGEN_LINEAR_AMX
namespace {

constexpr int64_t kPanel = kBf16PanelColumns;  // 32 columns: two B tiles of 16
constexpr int64_t kPanelRowBytes = 2 * kPanel * 2;  // one k-pair row of a panel, 128 bytes
constexpr int64_t kChunk = 32;  // features per TDPBF16PS: 64 bytes of bf16 per A-tile row
constexpr int64_t kTileRows = 16;
constexpr int64_t kBlockRows = 2 * kTileRows;  // rows per walk of a panel's chunks

// The 64-byte LDTILECFG operand (palette 1).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// C 0-3 and A 4-5 take the block's rows (the first 16 in tiles 0, 1, 4; the rest in 2, 3, 5);
// B 6-7 are always 16 k-pairs. Tiles of a half with no rows stay unconfigured (and unused).
TileConfig config_for(int64_t rows) {
  TileConfig cfg;
  const auto first = static_cast<uint8_t>(std::min(rows, kTileRows));
  const auto second = static_cast<uint8_t>(std::max<int64_t>(rows - kTileRows, 0));
  for (int tile : {0, 1, 4}) cfg.rows[tile] = first;
  for (int tile : {2, 3, 5}) cfg.rows[tile] = second;
  for (int tile : {6, 7}) cfg.rows[tile] = kTileRows;
  for (int tile = 0; tile < 8; ++tile) cfg.colsb[tile] = cfg.rows[tile] ? 64 : 0;
  return cfg;
}

// A block's sums in float32: up to 32 rows by the panel's 32 columns (C tiles 0-3 stored).
struct BlockSums {
  alignas(64) float c[kBlockRows][kPanel];
};

// y[r][0..ncols) for the `rows` (1..32) rows at x; the tiles must be configured for `rows`.
void panel_block(const uint16_t* x, int64_t ldx, int64_t rows, const uint16_t* panel,
                 int64_t K, uint16_t* y, int64_t ldy, int64_t ncols, const float* bias) {
  const bool two_halves = rows > kTileRows;
  const int64_t x_stride = ldx * 2;  // bytes between rows
  _tile_zero(0);
  _tile_zero(1);
  if (two_halves) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t whole_chunks = K / kChunk;
  for (int64_t c = 0; c < whole_chunks; ++c) {
    const uint16_t* b = panel + c * (kChunk / 2) * (kPanelRowBytes / 2);
    _tile_loadd(6, b, kPanelRowBytes);
    _tile_loadd(7, b + kPanel, kPanelRowBytes);  // columns 16-31: 64 bytes on
    _tile_loadd(4, x + c * kChunk, x_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (two_halves) {
      _tile_loadd(5, x + kTileRows * ldx + c * kChunk, x_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  BlockSums sums;
  constexpr int64_t ld = kPanel * sizeof(float);
  _tile_stored(0, &sums.c[0][0], ld);
  _tile_stored(1, &sums.c[0][16], ld);
  if (two_halves) {
    _tile_stored(2, &sums.c[kTileRows][0], ld);
    _tile_stored(3, &sums.c[kTileRows][16], ld);
  }

  alignas(64) float bias_row[kPanel] = {};
  if (bias != nullptr) std::memcpy(bias_row, bias, ncols * sizeof(float));
  const __m512 bias0 = _mm512_load_ps(bias_row), bias1 = _mm512_load_ps(bias_row + 16);
  const int64_t first_tail = whole_chunks * kChunk;
  for (int64_t r = 0; r < rows; ++r) {
    __m512 acc0 = _mm512_load_ps(&sums.c[r][0]);
    __m512 acc1 = _mm512_load_ps(&sums.c[r][16]);
    const uint16_t* row = x + r * ldx;
    // The features past the last whole chunk, a pair at a time (an odd last feature pairs
    // with the zero the packing put after it, and so with a zero of x's here).
    for (int64_t k = first_tail; k < K; k += 2) {
      const uint32_t high = k + 1 < K ? uint32_t{row[k + 1]} << 16 : 0u;
      const auto pair = static_cast<int32_t>(row[k] | high);
      const __m512bh xs = (__m512bh)_mm512_set1_epi32(pair);
      const uint16_t* w = panel + (k / 2) * (kPanelRowBytes / 2);
      acc0 = _mm512_dpbf16_ps(acc0, xs, (__m512bh)_mm512_loadu_si512(w));
      acc1 = _mm512_dpbf16_ps(acc1, xs, (__m512bh)_mm512_loadu_si512(w + kPanel));
    }
    store_bf16_panel_row(acc0, acc1, bias0, bias1, y + r * ldy, ncols);  // as VDPBF16PS's
  }
}

bool request_amx_permission() {
  // Linux hands out AMX's 8 KiB of tile state only to a process that asks for it (5.16+);
  // the request is process-wide, for every thread.
  constexpr long kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

}  // namespace

bool linear_bf16_amx() {
  // PAGEDGEN_CPU_AMX=0 keeps the VDPBF16PS kernel on an AMX CPU (tests run both kernels on
  // one machine; read once, at the first bf16 linear).
  static const bool ready = [] {
    const char* setting = std::getenv("PAGEDGEN_CPU_AMX");
    if (setting != nullptr && std::string(setting) == "0") return false;
    return request_amx_permission();
  }();
  return ready;
}

void packed_linear_bf16_amx(const uint16_t* x, int64_t ldx, int64_t M, int64_t K,
                            const uint16_t* packed, int64_t panels, uint16_t* y,
                            int64_t out_features, const float* bias) {
  const int64_t panel_size = ((K + 1) / 2) * (kPanelRowBytes / 2);  // uint16 per panel
  for_each_row_block_and_panel_range(
      M, 2 * K, kBlockRows, panels, [&](int64_t m0, int64_t rows, int64_t begin, int64_t end) {
        // The tile configuration is this thread's (a oneDNN call in between may have
        // replaced it), so it is set here: once for the block's whole 32-row groups, over
        // every panel (each panel's B tiles then serve them all from L1/L2), and once for
        // its last rows, over every panel again. (Switching per panel cost 33 rows about
        // what 48 cost.)
        const int64_t whole = rows / kBlockRows * kBlockRows;
        auto walk = [&](int64_t first, int64_t last, int64_t block) {
          const TileConfig cfg = config_for(block);
          _tile_loadconfig(&cfg);
          for (int64_t p = begin; p < end; ++p) {
            const int64_t n0 = p * kPanel;
            for (int64_t r = first; r < last; r += block) {
              panel_block(x + (m0 + r) * ldx, ldx, block, packed + p * panel_size, K,
                          y + (m0 + r) * out_features + n0, out_features,
                          std::min(kPanel, out_features - n0),
                          bias == nullptr ? nullptr : bias + n0);
            }
          }
        };
        if (whole > 0) walk(0, whole, kBlockRows);
        if (rows > whole) walk(whole, rows, rows - whole);
        _tile_release();  // back to the init state: no 8 KiB for the OS to save per switch
      });
}

#else  // not built for AMX

bool linear_bf16_amx() { return false; }

void packed_linear_bf16_amx(const uint16_t*, int64_t, int64_t, int64_t, const uint16_t*,
                            int64_t, uint16_t*, int64_t, const float*) {
  TORCH_CHECK(false, "packed_linear_bf16_amx: this build does not target AMX");
}

#endif

}  // namespace pagedgen_cpu
