// How the CPU linears (linear_cpu.cpp float32, linear_bf16_cpu.cpp bf16) walk their work:
// rows in blocks whose x fits in L2 (a 2048-row prefill chunk would otherwise read all of x
// again for every panel, from L3); within a block, panels split over the threads, so each
// thread streams its own part of the weight. A decode step is one block.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace pagedgen_cpu {

constexpr int64_t kLinearBlockBytes = 192 * 1024;  // of x per row block: L2 (512 KiB+) holds it

// fn(first_row, rows, first_panel, end_panel) for every row block and each thread's range of
// its panels; blocks are a multiple of group_rows (the kernel's row group), at least one group.
template <typename Fn>
void for_each_row_block_and_panel_range(int64_t num_rows, int64_t x_row_bytes,
                                        int64_t group_rows, int64_t num_panels, const Fn& fn) {
  const int64_t block_rows = std::max<int64_t>(
      group_rows,
      (kLinearBlockBytes / std::max<int64_t>(x_row_bytes, 1)) / group_rows * group_rows);
  for (int64_t m0 = 0; m0 < num_rows; m0 += block_rows) {
    const int64_t rows = std::min(block_rows, num_rows - m0);
    at::parallel_for(0, num_panels, 1,
                     [&](int64_t begin, int64_t end) { fn(m0, rows, begin, end); });
  }
}

// fn(first_row, rows, panel) for every row block and panel, as above.
template <typename Fn>
void for_each_row_block_and_panel(int64_t num_rows, int64_t x_row_bytes, int64_t group_rows,
                                  int64_t num_panels, const Fn& fn) {
  for_each_row_block_and_panel_range(
      num_rows, x_row_bytes, group_rows, num_panels,
      [&](int64_t m0, int64_t rows, int64_t begin, int64_t end) {
        for (int64_t p = begin; p < end; ++p) fn(m0, rows, p);
      });
}

// group(std::integral_constant<int, R>{}, first_row) over `rows` rows in groups of kMaxRows,
// then one group of the rows left: each kernel's row count is a compile-time constant, so its
// accumulators stay in registers.
template <int R, typename Group>
inline void last_row_group(int64_t left, int64_t first_row, const Group& group) {
  if constexpr (R > 0) {
    if (left == R) {
      group(std::integral_constant<int, R>{}, first_row);
    } else {
      last_row_group<R - 1>(left, first_row, group);
    }
  }
}

template <int kMaxRows, typename Group>
inline void for_each_row_group(int64_t rows, const Group& group) {
  int64_t r = 0;
  for (; r + kMaxRows <= rows; r += kMaxRows) group(std::integral_constant<int, kMaxRows>{}, r);
  last_row_group<kMaxRows - 1>(rows - r, r, group);
}

}  // namespace pagedgen_cpu
