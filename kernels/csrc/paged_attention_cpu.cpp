// Paged attention for the CPU: every query token of a mixed batch (prefill chunks and decode
// tokens) attends over its sequence's context by walking the block table in place.
//
// Why a kernel of our own instead of torch ops: the torch path gathers each sequence's whole
// K/V through the block table into contiguous tensors, then SDPA reads them again, so the cache
// crosses memory two to three times per step. Here each K/V block of a (sequence, KV head) is
// read once, straight from the pool, and used by every query row that needs it: the query heads
// sharing that KV head (GQA without repeating K/V) times the tokens of a query tile.
//
// Plain C++ loops compiled with -O3 -march=native and `omp simd` hints: the compiler
// vectorizes them for the build machine's ISA (AVX2, AVX-512, NEON) with no intrinsics to keep
// per ISA. Math is float32 with an online softmax; bf16/fp16 K/V blocks are widened once into a
// small float buffer.
//
// Layouts (shared with kernels/reference.py):
//   out, query       [num_tokens, num_heads, head_size]
//   key/value_cache  [num_blocks, block_size, num_kv_heads, head_size] (any strides, last = 1)
//   block_tables     [num_seqs, max_blocks_per_seq] int32
//   seq_lens         [num_seqs] int32            context length including the new tokens
//   query_start_loc  [num_seqs + 1] int32        cumulative query lengths

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "cpu_math.h"
#include "cpu_ops.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using pagedgen_cpu::exp_nonpositive;
using pagedgen_cpu::from_float;
using pagedgen_cpu::to_float;

// Query tokens per work item. With a GQA group of g the item has up to kTileTokens * g query
// rows sharing each K/V block read; 16 keeps the float accumulators (rows x head_size) in L1/L2.
constexpr int64_t kTileTokens = 16;

struct WorkItem {
  int64_t seq;
  int64_t kv_head;  // first KV head of the item
  int64_t num_kv_heads;  // KV heads it covers (consecutive)
  int64_t token_begin;  // first query token of the tile, relative to the sequence's query
  int64_t token_end;
  int64_t cost;  // rows x keys, to hand out the big items first
};

struct Problem {
  int64_t num_heads, num_kv_heads, group, head_size, block_size, max_blocks;
  int64_t q_stride_token, out_stride_token;
  int64_t kv_stride_block, kv_stride_token, kv_stride_head;
  float scale;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
};

// A score q . k is summed in one order whatever path computes it (a decode row's dot product,
// a prefill tile's block of transposed keys): lane l sums the products of head dims l, l + 16,
// ... in turn, then the lanes are added pairwise (l + 8 into l, then + 4, + 2, + 1). Two orders
// gave a token's output different last bits when it was computed in a prefill (a recompute
// after preemption, a prompt behind a shorter cached prefix) than in a decode, and seeded
// samples drew another token from there on (tests/engine/test_preemption.py). std::fma, not
// a * b + c, so that no compiler contracts one path and not the other (on x86 without FMA,
// pre-2013, it is a libm call: correct, slow).
constexpr int64_t kLanes = 16;

inline float ordered_dot(const float* q, const float* k, int64_t d) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes) {
#pragma omp simd
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] = std::fma(q[i + l], k[i + l], lanes[l]);
  }
  for (int64_t l = 0; i + l < d; ++l) lanes[l] = std::fma(q[i + l], k[i + l], lanes[l]);
  for (int64_t width = kLanes / 2; width >= 1; width /= 2) {
#pragma omp simd
    for (int64_t l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  }
  return lanes[0];
}

template <typename scalar_t>
inline void widen(const scalar_t* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

// One (sequence, KV heads, query tile): rows are (token, query head) pairs for the query
// heads of those KV heads. Each K/V block is read from the pool once and used by every row;
// an item covering all KV heads reads each block as one contiguous run, which the hardware
// prefetcher streams (one head's rows are strided). kHead is the head size as
// a compile-time constant (0: runtime), so the head-size loops unroll into whole vector
// registers and a row's accumulator stays in registers across a block's keys.
template <typename scalar_t, int64_t kBlock, int64_t kHead>
void attend_tile(const Problem& p, const WorkItem& w, const scalar_t* query,
                 const scalar_t* key_cache, const scalar_t* value_cache, scalar_t* out,
                 std::vector<float>& scratch) {
  const int64_t d = kHead ? kHead : p.head_size;
  const int64_t group = p.group;
  const int64_t heads = w.num_kv_heads;
  const int64_t row_heads = heads * group;  // rows per query token
  const int64_t kv_width = heads * d;  // floats per token in the key/value buffers
  const int64_t num_rows = (w.token_end - w.token_begin) * row_heads;
  const int64_t query_start = p.query_start_loc[w.seq];
  const int64_t query_len = p.query_start_loc[w.seq + 1] - query_start;
  const int64_t context_start = p.seq_lens[w.seq] - query_len;  // position of query token 0
  const int64_t num_keys = context_start + w.token_end;  // keys the last token of the tile sees

  // Many rows (a prefill tile) share each block's keys: transposing them once to [d, kBlock]
  // makes a row's scores kBlock-wide vector FMAs. A decode item has only `group` rows, too few
  // to pay for the transpose: its scores are dot products over the head dimension.
  const bool transpose_keys = (w.token_end - w.token_begin) * group >= kBlock;
  scratch.resize(static_cast<size_t>(2 * num_rows * d + 2 * num_rows + 3 * kBlock * kv_width));
  float* q = scratch.data();      // [rows, d], pre-scaled
  float* acc = q + num_rows * d;  // [rows, d]
  float* row_max = acc + num_rows * d;
  float* row_sum = row_max + num_rows;
  float* keys = row_sum + num_rows;            // [kBlock, heads, d] this block's keys as float
  float* values = keys + kBlock * kv_width;    // [kBlock, heads, d] its values as float
  float* keys_t = values + kBlock * kv_width;  // [heads, d, kBlock] keys transposed (prefill)

  for (int64_t t = w.token_begin; t < w.token_end; ++t) {
    const scalar_t* src = query + (query_start + t) * p.q_stride_token + w.kv_head * group * d;
    float* dst = q + (t - w.token_begin) * row_heads * d;
    widen(src, dst, row_heads * d);
#pragma omp simd
    for (int64_t i = 0; i < row_heads * d; ++i) dst[i] *= p.scale;
  }
  std::fill(acc, acc + num_rows * d, 0.f);
  std::fill(row_max, row_max + num_rows, -std::numeric_limits<float>::infinity());
  std::fill(row_sum, row_sum + num_rows, 0.f);

  const int32_t* table = p.block_tables + w.seq * p.max_blocks;
  const int64_t num_blocks = (num_keys + kBlock - 1) / kBlock;
  // Only where the item's rows are strided, as for an item of one KV head (a step of fewer
  // query tiles than 4 x threads, e.g. decodes of up to 7 sequences on 2 threads; figures
  // below). A block the item reads as one contiguous run (all heads, a dense cache) the
  // hardware prefetcher streams once its first lines arrive, and prefetches only cost
  // instructions there (30 layers of 32 sequences over 128-256 keys: bf16 26.3 ms cold with,
  // 24.4 without; fp32 39.9, 34.4; with L1 as their target).
  const bool prefetch = !(heads == p.num_kv_heads && p.kv_stride_head == d &&
                          p.kv_stride_token == kv_width);
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t first_key = b * kBlock;
    const int64_t keys_here = std::min(kBlock, num_keys - first_key);
    const int64_t offset = static_cast<int64_t>(table[b]) * p.kv_stride_block +
                           w.kv_head * p.kv_stride_head;
    if (prefetch && b + 1 < num_blocks) {
      // Blocks sit anywhere in the pool, so the hardware prefetcher cannot guess the next one:
      // ask for it now, and its loads overlap this block's math (measured: the copy below was
      // most of the kernel's time, stalled on memory). Into L2 (locality 2: prefetcht1 on
      // x86, PLDL2KEEP on AArch64), not L1. 30 layers of one bf16 sequence over 2048 keys,
      // cold, this machine (AMD EPYC, Zen 4, 2 threads), three rounds of none / L1 / L2 back
      // to back: 8.9-9.4 / 8.3-10.1 / 4.6-7.0 ms; float32 10.8-11.2 / 10.5-12.1 / 6.2-9.0;
      // four bf16 sequences 27.9-31.8 / 24.8-26.8 / 13.9-16.0. Likely why L1 loses: a
      // block's 2 x block_size rows are more lines than L1 keeps in flight, so the prefetches
      // wait on one another (not measured with counters; on a CPU whose every prefetch level
      // fills L1 this changes nothing).
      const int64_t next = static_cast<int64_t>(table[b + 1]) * p.kv_stride_block +
                           w.kv_head * p.kv_stride_head;
      const int64_t keys_next = std::min(kBlock, num_keys - first_key - kBlock);
      const int64_t row_bytes =
          ((heads - 1) * p.kv_stride_head + d) * static_cast<int64_t>(sizeof(scalar_t));
      auto prefetch_row = [row_bytes](const scalar_t* row) {
        // Every line the row touches: from the line it starts in (a row need not start on a
        // line, e.g. head size 80 in bf16) to the one it ends in.
        const uintptr_t start = reinterpret_cast<uintptr_t>(row);
        for (uintptr_t line = start & ~uintptr_t{63}; line < start + row_bytes; line += 64) {
          __builtin_prefetch(reinterpret_cast<const void*>(line), 0, 2);
        }
      };
      for (int64_t j = 0; j < keys_next; ++j) {
        prefetch_row(key_cache + next + j * p.kv_stride_token);
        prefetch_row(value_cache + next + j * p.kv_stride_token);
      }
    }
    // The one read of this block's K/V for this item: into dense float rows (a copy for fp32,
    // a widening for bf16/fp16), so every loop below has compile-time strides.
    for (int64_t j = 0; j < keys_here; ++j) {
      const int64_t row = offset + j * p.kv_stride_token;
      if (p.kv_stride_head == d) {  // the item's heads are one contiguous run per token
        widen(key_cache + row, keys + j * kv_width, kv_width);
        widen(value_cache + row, values + j * kv_width, kv_width);
      } else {
        for (int64_t h = 0; h < heads; ++h) {
          widen(key_cache + row + h * p.kv_stride_head, keys + j * kv_width + h * d, d);
          widen(value_cache + row + h * p.kv_stride_head, values + j * kv_width + h * d, d);
        }
      }
    }
    if (transpose_keys) {
      for (int64_t h = 0; h < heads; ++h) {
        float* kt = keys_t + h * d * kBlock;
        for (int64_t j = 0; j < kBlock; ++j) {
          for (int64_t i = 0; i < d; ++i) {
            kt[i * kBlock + j] = j < keys_here ? keys[j * kv_width + h * d + i] : 0.f;
          }
        }
      }
    }
    for (int64_t r = 0; r < num_rows; ++r) {
      // Causal: token t sits at context_start + t and sees keys up to that position.
      const int64_t position = context_start + w.token_begin + r / row_heads;
      const int64_t visible = std::min(keys_here, position - first_key + 1);
      if (visible <= 0) continue;
      const int64_t kv = (r % row_heads) / group;  // this row's KV head within the item
      const float* q_row = q + r * d;
      const float* head_keys = keys + kv * d;  // token j at head_keys + j * kv_width
      const float* head_values = values + kv * d;
      const float* head_keys_t = keys_t + kv * d * kBlock;
      float s[kBlock];
      if (transpose_keys) {
        // The scores of up to 16 keys at once: kLanes partial sums per key, each a vector over
        // the keys, summed as ordered_dot sums one key's lanes. Unrolled over the lanes so the
        // 16 partial vectors stay in registers (in a stack array they cost a load and a store
        // per FMA: prefill attention ran 1.6x slower).
        constexpr int64_t kKeys = kBlock < 16 ? kBlock : 16;
        static_assert(kBlock % kKeys == 0, "the key groups must tile the block (s[kBlock])");
        for (int64_t j0 = 0; j0 < kBlock; j0 += kKeys) {
          float part[kLanes][kKeys] = {};
          int64_t i = 0;
          for (; i + kLanes <= d; i += kLanes) {
#pragma GCC unroll 16
            for (int64_t l = 0; l < kLanes; ++l) {
              const float qi = q_row[i + l];
              const float* kt = head_keys_t + (i + l) * kBlock + j0;
#pragma omp simd
              for (int64_t j = 0; j < kKeys; ++j) part[l][j] = std::fma(qi, kt[j], part[l][j]);
            }
          }
          for (int64_t l = 0; i + l < d; ++l) {
            const float qi = q_row[i + l];
            const float* kt = head_keys_t + (i + l) * kBlock + j0;
#pragma omp simd
            for (int64_t j = 0; j < kKeys; ++j) part[l][j] = std::fma(qi, kt[j], part[l][j]);
          }
#pragma GCC unroll 4
          for (int64_t width = kLanes / 2; width >= 1; width /= 2) {
#pragma GCC unroll 8
            for (int64_t l = 0; l < width; ++l) {
#pragma omp simd
              for (int64_t j = 0; j < kKeys; ++j) part[l][j] += part[l + width][j];
            }
          }
#pragma omp simd
          for (int64_t j = 0; j < kKeys; ++j) s[j0 + j] = part[0][j];
        }
      } else {
        for (int64_t j = 0; j < visible; ++j) {
          s[j] = ordered_dot(q_row, head_keys + j * kv_width, d);
        }
      }
      float block_max = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : block_max)
      for (int64_t j = 0; j < visible; ++j) block_max = std::max(block_max, s[j]);
      const float new_max = std::max(row_max[r], block_max);
      const float correction = exp_nonpositive(row_max[r] - new_max);  // ~0 on the first block
      float block_sum = 0.f;
#pragma omp simd reduction(+ : block_sum)
      for (int64_t j = 0; j < visible; ++j) {
        s[j] = exp_nonpositive(s[j] - new_max);
        block_sum += s[j];
      }
      row_max[r] = new_max;
      row_sum[r] = row_sum[r] * correction + block_sum;
      float* acc_row = acc + r * d;
      if constexpr (kHead > 0) {
        // The row's accumulator in registers across the block's keys: d / vector-width
        // independent FMA chains, one pass over the values.
        float a[kHead];
#pragma omp simd
        for (int64_t i = 0; i < kHead; ++i) a[i] = acc_row[i] * correction;
        for (int64_t j = 0; j < visible; ++j) {
          const float weight = s[j];
          const float* v = head_values + j * kv_width;
#pragma omp simd
          for (int64_t i = 0; i < kHead; ++i) a[i] += weight * v[i];
        }
#pragma omp simd
        for (int64_t i = 0; i < kHead; ++i) acc_row[i] = a[i];
      } else {
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) acc_row[i] *= correction;
        for (int64_t j = 0; j < visible; ++j) {
          const float weight = s[j];
          const float* v = head_values + j * kv_width;
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) acc_row[i] += weight * v[i];
        }
      }
    }
  }

  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t t = w.token_begin + r / row_heads;
    const int64_t head = w.kv_head * group + r % row_heads;
    scalar_t* dst = out + (query_start + t) * p.out_stride_token + head * d;
    const float inv_sum = 1.f / row_sum[r];  // every row sees at least key 0
    const float* acc_row = acc + r * d;
    for (int64_t i = 0; i < d; ++i) dst[i] = from_float<scalar_t>(acc_row[i] * inv_sum);
  }
}

template <typename scalar_t, int64_t kBlock>
void attend_block_size(const Problem& p, const WorkItem& w, const scalar_t* query,
                       const scalar_t* key_cache, const scalar_t* value_cache, scalar_t* out,
                       std::vector<float>& scratch) {
  switch (p.head_size) {  // the common head sizes unrolled, any other at runtime
    case 64: return attend_tile<scalar_t, kBlock, 64>(p, w, query, key_cache, value_cache, out,
                                                       scratch);
    case 128: return attend_tile<scalar_t, kBlock, 128>(p, w, query, key_cache, value_cache,
                                                         out, scratch);
    default: return attend_tile<scalar_t, kBlock, 0>(p, w, query, key_cache, value_cache, out,
                                                      scratch);
  }
}

template <typename scalar_t>
void attend(const Problem& p, const WorkItem& w, const scalar_t* query, const scalar_t* key_cache,
            const scalar_t* value_cache, scalar_t* out, std::vector<float>& scratch) {
  // The block size as a compile-time constant too (checked to be one of these up front).
  switch (p.block_size) {
    case 8: return attend_block_size<scalar_t, 8>(p, w, query, key_cache, value_cache, out,
                                                  scratch);
    case 16: return attend_block_size<scalar_t, 16>(p, w, query, key_cache, value_cache, out,
                                                    scratch);
    case 32: return attend_block_size<scalar_t, 32>(p, w, query, key_cache, value_cache, out,
                                                    scratch);
    default: return attend_block_size<scalar_t, 64>(p, w, query, key_cache, value_cache, out,
                                                    scratch);
  }
}

void check_args(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                const at::Tensor& value_cache, const at::Tensor& block_tables,
                const at::Tensor& seq_lens, const at::Tensor& query_start_loc) {
  for (const at::Tensor* t : {&out, &query, &key_cache, &value_cache, &block_tables, &seq_lens,
                              &query_start_loc}) {
    TORCH_CHECK(t->device().is_cpu(), "paged_attention_cpu: every tensor must be on the CPU");
  }
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(),
              "paged_attention_cpu: query and out must be [num_tokens, num_heads, head_size]");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes() &&
                  key_cache.strides() == value_cache.strides(),
              "paged_attention_cpu: key/value caches must be alike "
              "[num_blocks, block_size, num_kv_heads, head_size]");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() &&
                  query.scalar_type() == out.scalar_type() &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "paged_attention_cpu: query, caches and out must share one dtype, got ",
              query.scalar_type(), " and ", key_cache.scalar_type());
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2) && out.stride(2) == 1 &&
                  out.stride(1) == out.size(2) && key_cache.stride(3) == 1,
              "paged_attention_cpu: heads of query/out and the cache's head_size must be dense");
  TORCH_CHECK(query.size(2) == key_cache.size(3), "paged_attention_cpu: head_size mismatch");
  const int64_t block_size = key_cache.size(1);
  TORCH_CHECK(block_size == 8 || block_size == 16 || block_size == 32 || block_size == 64,
              "paged_attention_cpu: block_size must be 8, 16, 32 or 64, got ", block_size);
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0,
              "paged_attention_cpu: num_heads must be a multiple of num_kv_heads");
  for (const at::Tensor* t : {&block_tables, &seq_lens, &query_start_loc}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(),
                "paged_attention_cpu: block_tables, seq_lens, query_start_loc must be "
                "contiguous int32");
  }
  TORCH_CHECK(block_tables.dim() == 2 && seq_lens.size(0) == block_tables.size(0) &&
                  query_start_loc.size(0) == seq_lens.size(0) + 1,
              "paged_attention_cpu: block_tables [S, B], seq_lens [S], query_start_loc [S + 1]");
}

}  // namespace

namespace pagedgen_cpu {

void paged_attention_cpu(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                         const at::Tensor& value_cache, const at::Tensor& block_tables,
                         const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                         double scale) {
  check_args(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc);
  Problem p;
  p.num_heads = query.size(1);
  p.num_kv_heads = key_cache.size(2);
  p.group = p.num_heads / p.num_kv_heads;
  p.head_size = query.size(2);
  p.block_size = key_cache.size(1);
  p.max_blocks = block_tables.size(1);
  p.q_stride_token = query.stride(0);
  p.out_stride_token = out.stride(0);
  p.kv_stride_block = key_cache.stride(0);
  p.kv_stride_token = key_cache.stride(1);
  p.kv_stride_head = key_cache.stride(2);
  p.scale = static_cast<float>(scale);
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.query_start_loc = query_start_loc.data_ptr<int32_t>();

  const int64_t num_seqs = seq_lens.size(0);
  // Enough (sequence, tile) pairs to keep every thread busy: one item per pair, covering all
  // KV heads (contiguous block reads). Otherwise (batch 1, a few long prefills) one item per
  // KV head too, so the threads share the work.
  int64_t num_tiles = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    num_tiles += (p.query_start_loc[s + 1] - p.query_start_loc[s] + kTileTokens - 1) /
                 kTileTokens;
  }
  const int64_t heads_per_item =
      num_tiles >= 4 * static_cast<int64_t>(at::get_num_threads()) ? p.num_kv_heads : 1;
  TORCH_CHECK(p.query_start_loc[0] == 0 && p.query_start_loc[num_seqs] == query.size(0),
              "paged_attention_cpu: query_start_loc must run from 0 to the ", query.size(0),
              " query tokens, got ", p.query_start_loc[0], " to ", p.query_start_loc[num_seqs]);
  const int64_t num_pool_blocks = key_cache.size(0);
  std::vector<WorkItem> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t query_len = p.query_start_loc[s + 1] - p.query_start_loc[s];
    const int64_t context_start = p.seq_lens[s] - query_len;
    TORCH_CHECK(query_len >= 0 && context_start >= 0 &&
                    (p.seq_lens[s] + p.block_size - 1) / p.block_size <= p.max_blocks,
                "paged_attention_cpu: sequence ", s, " has query length ", query_len,
                " and context length ", p.seq_lens[s], ", which its block table cannot hold");
    // Every block the sequence reads must be in the pool (a bad id would read outside it).
    const int32_t* table = p.block_tables + s * p.max_blocks;
    for (int64_t b = 0; b < (p.seq_lens[s] + p.block_size - 1) / p.block_size; ++b) {
      TORCH_CHECK(table[b] >= 0 && table[b] < num_pool_blocks, "paged_attention_cpu: sequence ",
                  s, " block ", b, " is ", table[b], ", outside the pool's ", num_pool_blocks,
                  " blocks");
    }
    for (int64_t t = 0; t < query_len; t += kTileTokens) {
      const int64_t end = std::min(query_len, t + kTileTokens);
      for (int64_t h = 0; h < p.num_kv_heads; h += heads_per_item) {
        items.push_back({s, h, heads_per_item, t, end,
                         heads_per_item * (end - t) * (context_start + end)});
      }
    }
  }
  // Largest first, handed out one by one from a shared counter: a long prefill chunk and many
  // short decodes in one step still keep every thread busy to the end.
  std::stable_sort(items.begin(), items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  const int64_t num_items = static_cast<int64_t>(items.size());
  if (num_items == 0) return;
  const int64_t num_workers = std::min<int64_t>(at::get_num_threads(), num_items);
  std::atomic<int64_t> next{0};

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, query.scalar_type(), "paged_attention_cpu", [&] {
        const scalar_t* q = query.data_ptr<scalar_t>();
        const scalar_t* k = key_cache.data_ptr<scalar_t>();
        const scalar_t* v = value_cache.data_ptr<scalar_t>();
        scalar_t* o = out.data_ptr<scalar_t>();
        at::parallel_for(0, num_workers, 1, [&](int64_t begin, int64_t end) {
          std::vector<float> scratch;
          for (int64_t worker = begin; worker < end; ++worker) {
            for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) {
              attend<scalar_t>(p, items[i], q, k, v, o, scratch);
            }
          }
        });
      });
}

// Writes each new token's K and V into its slot (block * block_size + offset; -1 = padding,
// skipped). One op per layer where the torch path takes five (a padding check that syncs,
// index conversions, two index_copy_): at batch 1 those small ops were a visible share of
// the step.
void reshape_and_cache_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                           at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key_cache.dim() == 4 &&
                  key_cache.sizes() == value_cache.sizes() &&
                  key_cache.strides() == value_cache.strides(),
              "reshape_and_cache_cpu: key/value [tokens, kv_heads, head_size], caches "
              "[blocks, block_size, kv_heads, head_size]");
  TORCH_CHECK(key.size(1) == key_cache.size(2) && key.size(2) == key_cache.size(3),
              "reshape_and_cache_cpu: key/value heads do not match the cache's");
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() &&
                  value.scalar_type() == key_cache.scalar_type() &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "reshape_and_cache_cpu: key, value and caches must share one dtype");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && key_cache.stride(3) == 1 &&
                  key.stride(1) == key.size(2) && value.stride(1) == value.size(2),
              "reshape_and_cache_cpu: head_size must be the dense dimension");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.size(0) == key.size(0),
              "reshape_and_cache_cpu: slot_mapping must be contiguous int64 [tokens]");
  const int64_t num_tokens = key.size(0), kv_heads = key.size(1), head = key.size(2);
  const int64_t block_size = key_cache.size(1), num_slots = key_cache.size(0) * block_size;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t element = key.element_size();
  const bool dense_token = key_cache.stride(2) == head;  // a token's heads are contiguous
  auto copy = [&](const at::Tensor& src, at::Tensor& cache) {
    const char* from = static_cast<const char*>(src.data_ptr());
    char* to = static_cast<char*>(cache.data_ptr());
    for (int64_t t = 0; t < num_tokens; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      TORCH_CHECK(slot < num_slots, "reshape_and_cache_cpu: slot ", slot, " is past the pool's ",
                  num_slots, " slots");
      char* dst = to + ((slot / block_size) * cache.stride(0) +
                        (slot % block_size) * cache.stride(1)) * element;
      const char* row = from + t * src.stride(0) * element;
      if (dense_token) {
        std::memcpy(dst, row, kv_heads * head * element);
      } else {
        for (int64_t h = 0; h < kv_heads; ++h) {
          std::memcpy(dst + h * cache.stride(2) * element, row + h * head * element,
                      head * element);
        }
      }
    }
  };
  copy(key, key_cache);
  copy(value, value_cache);
}

}  // namespace pagedgen_cpu

TORCH_LIBRARY(pagedgen_cpu, m) {
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping) -> ()");
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(pagedgen_cpu, CPU, m) {
  m.impl("paged_attention", &pagedgen_cpu::paged_attention_cpu);
  m.impl("reshape_and_cache", &pagedgen_cpu::reshape_and_cache_cpu);
}
