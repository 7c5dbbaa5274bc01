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

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

// Query tokens per work item. With a GQA group of g the item has up to kTileTokens * g query
// rows sharing each K/V block read; 16 keeps the float accumulators (rows x head_size) in L1/L2.
constexpr int64_t kTileTokens = 16;

struct WorkItem {
  int64_t seq;
  int64_t kv_head;
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

template <typename scalar_t>
inline void widen(const scalar_t* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// One (sequence, KV head, query tile): rows are (token, query head of the group) pairs.
template <typename scalar_t>
void attend_tile(const Problem& p, const WorkItem& w, const scalar_t* query,
                 const scalar_t* key_cache, const scalar_t* value_cache, scalar_t* out,
                 std::vector<float>& scratch) {
  const int64_t d = p.head_size, bs = p.block_size, group = p.group;
  const int64_t num_rows = (w.token_end - w.token_begin) * group;
  const int64_t query_start = p.query_start_loc[w.seq];
  const int64_t query_len = p.query_start_loc[w.seq + 1] - query_start;
  const int64_t context_start = p.seq_lens[w.seq] - query_len;  // position of query token 0
  const int64_t num_keys = context_start + w.token_end;  // keys the last token of the tile sees

  scratch.resize(static_cast<size_t>(2 * num_rows * d + 2 * num_rows + num_rows * bs +
                                     2 * bs * d));
  float* q = scratch.data();    // [rows, d], pre-scaled
  float* acc = q + num_rows * d;  // [rows, d]
  float* row_max = acc + num_rows * d;
  float* row_sum = row_max + num_rows;
  float* scores = row_sum + num_rows;  // [rows, bs]
  float* key_buf = scores + num_rows * bs;  // [bs, d] widened keys (bf16/fp16 caches)
  float* value_buf = key_buf + bs * d;

  for (int64_t t = w.token_begin; t < w.token_end; ++t) {
    const scalar_t* src = query + (query_start + t) * p.q_stride_token + w.kv_head * group * d;
    float* dst = q + (t - w.token_begin) * group * d;
    widen(src, dst, group * d);
#pragma omp simd
    for (int64_t i = 0; i < group * d; ++i) dst[i] *= p.scale;
  }
  std::fill(acc, acc + num_rows * d, 0.f);
  std::fill(row_max, row_max + num_rows, -std::numeric_limits<float>::infinity());
  std::fill(row_sum, row_sum + num_rows, 0.f);

  const int32_t* table = p.block_tables + w.seq * p.max_blocks;
  const int64_t num_blocks = (num_keys + bs - 1) / bs;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t first_key = b * bs;
    const int64_t keys_here = std::min(bs, num_keys - first_key);
    const int64_t offset = static_cast<int64_t>(table[b]) * p.kv_stride_block +
                           w.kv_head * p.kv_stride_head;
    const float* keys;
    const float* values;
    int64_t key_stride;
    if constexpr (std::is_same_v<scalar_t, float>) {
      keys = key_cache + offset;
      values = value_cache + offset;
      key_stride = p.kv_stride_token;
    } else {
      for (int64_t j = 0; j < keys_here; ++j) {
        widen(key_cache + offset + j * p.kv_stride_token, key_buf + j * d, d);
        widen(value_cache + offset + j * p.kv_stride_token, value_buf + j * d, d);
      }
      keys = key_buf;
      values = value_buf;
      key_stride = d;
    }
    for (int64_t r = 0; r < num_rows; ++r) {
      // Causal: token t sits at context_start + t and sees keys up to that position.
      const int64_t position = context_start + w.token_begin + r / group;
      const int64_t visible = std::min(keys_here, position - first_key + 1);
      if (visible <= 0) continue;
      float* s = scores + r * bs;
      const float* q_row = q + r * d;
      float block_max = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < visible; ++j) {
        s[j] = dot(q_row, keys + j * key_stride, d);
        block_max = std::max(block_max, s[j]);
      }
      const float new_max = std::max(row_max[r], block_max);
      const float correction = std::exp(row_max[r] - new_max);  // 0 on the first block
      float block_sum = 0.f;
      for (int64_t j = 0; j < visible; ++j) {
        s[j] = std::exp(s[j] - new_max);
        block_sum += s[j];
      }
      row_max[r] = new_max;
      row_sum[r] = row_sum[r] * correction + block_sum;
      float* acc_row = acc + r * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) acc_row[i] *= correction;
      for (int64_t j = 0; j < visible; ++j) {
        const float weight = s[j];
        const float* v = values + j * key_stride;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) acc_row[i] += weight * v[i];
      }
    }
  }

  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t t = w.token_begin + r / group;
    const int64_t head = w.kv_head * group + r % group;
    scalar_t* dst = out + (query_start + t) * p.out_stride_token + head * d;
    const float inv_sum = 1.f / row_sum[r];  // every row sees at least key 0
    const float* acc_row = acc + r * d;
    for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<scalar_t>(acc_row[i] * inv_sum);
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
  std::vector<WorkItem> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t query_len = p.query_start_loc[s + 1] - p.query_start_loc[s];
    const int64_t context_start = p.seq_lens[s] - query_len;
    TORCH_CHECK(query_len >= 0 && context_start >= 0 &&
                    (p.seq_lens[s] + p.block_size - 1) / p.block_size <= p.max_blocks,
                "paged_attention_cpu: sequence ", s, " has query length ", query_len,
                " and context length ", p.seq_lens[s], ", which its block table cannot hold");
    for (int64_t t = 0; t < query_len; t += kTileTokens) {
      const int64_t end = std::min(query_len, t + kTileTokens);
      for (int64_t h = 0; h < p.num_kv_heads; ++h) {
        items.push_back({s, h, t, end, (end - t) * (context_start + end)});
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
              attend_tile<scalar_t>(p, items[i], q, k, v, o, scratch);
            }
          }
        });
      });
}

}  // namespace

TORCH_LIBRARY(pagedgen_cpu, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(pagedgen_cpu, CPU, m) { m.impl("paged_attention", &paged_attention_cpu); }
