// The decoder layers of a Llama-family model in one op, for float32 and bfloat16 (on
// AVX512-BF16: its linears are ours too) on the CPU: the same
// kernels the Python layer loop calls (engine_service/model/models/llama.py), in the same order
// on the same tensors, so the result is the same to the bit, with no Python and no torch
// dispatch between them.
//
// Why: at batch 1 a decode step of SmolLM2 spent ~5 ms of its ~24 ms between the kernels
// (module calls, argument checks, views and dispatch of ~12 ops per layer, 30 layers), while
// its linears streamed the weights at the machine's read bandwidth; llama.cpp, which runs its
// graph in C, took 18.5 ms for the whole step. Here a layer costs its kernels and a few
// tensor views.
//
// Per layer (llama.py's DecoderLayer): residual += delta and RMSNorm; qkv projection (+ bias);
// each q and k head RMS-normed in place (Qwen3, where qk_norms are given; the model's one eps);
// rotary on q and k in place; K/V written to the paged cache; paged attention; o projection;
// residual += it and RMSNorm; gate_up projection; SiLU(gate) * up; down projection. The first
// layer's norm has no residual to add; the final norm adds the last layer's output.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "cpu_ops.h"

#include <chrono>
#include <ctime>
#include <cstdint>
#include <optional>
#include <tuple>

namespace {

// Per-layer weights in the list the op takes, in this order.
enum LayerWeight : int64_t {
  kInputNorm,
  kQkv,  // packed (pack_linear_weight)
  kOut,  // packed
  kPostNorm,
  kGateUp,  // packed
  kDown,  // packed
  kWeightsPerLayer,
};

// The clock bench/decode_step.py times whole steps with: the thread's CPU time with one torch
// thread (all the work is on it, and time descheduled on a busy machine is not the step's),
// wall time otherwise. The split adds this op's figures to its own, so they must be alike.
double now_seconds() {
  if (at::get_num_threads() == 1) {
    timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Adds the seconds `fn` takes to *total when timing is on (the decode-step benchmark's split).
template <typename Fn>
auto timed(double* total, Fn&& fn) {
  if (total == nullptr) return fn();
  struct Add {
    double* total;
    double start;
    ~Add() { *total += now_seconds() - start; }
  } add{total, now_seconds()};
  return fn();
}

// A packed weight (pack_linear_weight: float32 [ceil(out / 16), in, 16], bfloat16
// [ceil(out / 32), ceil(in / 2), 64]) of the shape and dtype this layer needs; the message
// names the layer, the projection and both shapes.
void check_packed(const at::Tensor& packed, at::ScalarType dtype, int64_t layer, const char* name,
                  int64_t in_features, int64_t out_features) {
  const bool bf16 = dtype == at::kBFloat16;
  const int64_t columns = bf16 ? pagedgen_cpu::kBf16PanelColumns : pagedgen_cpu::kFloatPanelColumns;
  const int64_t panels = (out_features + columns - 1) / columns;
  const int64_t rows = bf16 ? (in_features + 1) / 2 : in_features;
  const int64_t width = bf16 ? 2 * columns : columns;
  TORCH_CHECK(packed.scalar_type() == dtype && packed.dim() == 3 && packed.size(0) == panels &&
                  packed.size(1) == rows && packed.size(2) == width,
              "decoder_forward: layer ", layer, " ", name, " must be packed ", dtype, " [", panels,
              ", ", rows, ", ", width, "] for ", in_features, " -> ", out_features,
              " features, got ", packed.scalar_type(), " ", packed.sizes());
}

}  // namespace

namespace pagedgen_cpu {

// x: the embedded tokens [tokens, hidden], used as the residual stream (updated in place).
// Returns the hidden states after the final norm. timings (optional, float64 [2]): seconds
// spent in the linears and in attention (cache writes included) are added to it, in thread CPU
// time with one torch thread, else wall time (now_seconds).
at::Tensor decoder_forward(at::Tensor x, at::TensorList layer_weights, at::TensorList qkv_biases,
                           at::TensorList qk_norms,
                           const at::Tensor& final_norm, const at::Tensor& kv_caches,
                           const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                           const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t intermediate,
                           double eps, double scale,
                           const std::optional<at::Tensor>& timings) {
  const int64_t num_layers = static_cast<int64_t>(layer_weights.size()) / kWeightsPerLayer;
  TORCH_CHECK(num_layers >= 1 &&
                  static_cast<int64_t>(layer_weights.size()) == num_layers * kWeightsPerLayer,
              "decoder_forward: layer_weights must hold ", int64_t{kWeightsPerLayer},
              " tensors per layer, got ", layer_weights.size());
  TORCH_CHECK(qkv_biases.empty() || static_cast<int64_t>(qkv_biases.size()) == num_layers,
              "decoder_forward: qkv_biases must be empty or one per layer, got ",
              qkv_biases.size(), " for ", num_layers, " layers");
  TORCH_CHECK(qk_norms.empty() || static_cast<int64_t>(qk_norms.size()) == 2 * num_layers,
              "decoder_forward: qk_norms must be empty or two per layer (q, k), got ",
              qk_norms.size(), " for ", num_layers, " layers");
  TORCH_CHECK(kv_caches.dim() == 6 && kv_caches.size(0) == num_layers && kv_caches.size(1) == 2,
              "decoder_forward: kv_caches must be [layers, 2, blocks, block_size, kv_heads, "
              "head_dim] with ", num_layers, " layers, got ", kv_caches.sizes());
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "decoder_forward: x must be contiguous float32 or bfloat16 [tokens, hidden], got ",
              x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(num_heads >= 1 && num_kv_heads >= 1 && head_dim >= 1 && intermediate >= 1,
              "decoder_forward: num_heads, num_kv_heads, head_dim, intermediate_size must be "
              ">= 1, got ", num_heads, ", ", num_kv_heads, ", ", head_dim, ", ", intermediate);
  double* seconds = nullptr;
  if (timings.has_value() && timings->defined()) {
    TORCH_CHECK(timings->scalar_type() == at::kDouble && timings->numel() == 2 &&
                    timings->is_contiguous(),
                "decoder_forward: timings must be float64 [2]");
    seconds = timings->data_ptr<double>();
  }
  double* linear_seconds = seconds;
  double* attention_seconds = seconds == nullptr ? nullptr : seconds + 1;

  const int64_t num_tokens = x.size(0), hidden = x.size(1);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const int64_t qkv_size = q_size + 2 * kv_size;
  const at::ScalarType dtype = x.scalar_type();
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    const at::Tensor* w = layer_weights.data() + layer * kWeightsPerLayer;
    check_packed(w[kQkv], dtype, layer, "qkv", hidden, qkv_size);
    check_packed(w[kOut], dtype, layer, "o", q_size, hidden);
    check_packed(w[kGateUp], dtype, layer, "gate_up", hidden, 2 * intermediate);
    check_packed(w[kDown], dtype, layer, "down", intermediate, hidden);
  }
  auto linear = [&](const at::Tensor& in, const at::Tensor& packed,
                    const std::optional<at::Tensor>& bias, int64_t out_features) {
    return timed(linear_seconds, [&] { return packed_linear(in, packed, bias, out_features); });
  };

  at::Tensor residual = x, delta, h;
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    const at::Tensor* w = layer_weights.data() + layer * kWeightsPerLayer;
    if (layer == 0) {
      h = rms_norm_cpu(residual, w[kInputNorm], eps);
    } else {
      std::tie(residual, h) = add_rms_norm_cpu(residual, delta, w[kInputNorm], eps);
    }
    std::optional<at::Tensor> bias;
    if (!qkv_biases.empty()) bias = qkv_biases[layer];
    at::Tensor qkv = linear(h, w[kQkv], bias, qkv_size);
    if (!qk_norms.empty()) {
      head_rms_norm_cpu(qkv, qk_norms[2 * layer], qk_norms[2 * layer + 1], num_heads,
                        num_kv_heads, head_dim, eps);
    }
    rotary_cpu(qkv, cos, sin, num_heads + num_kv_heads, head_dim);
    const at::Tensor q = qkv.narrow(1, 0, q_size).view({num_tokens, num_heads, head_dim});
    const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({num_tokens, num_kv_heads, head_dim});
    const at::Tensor v =
        qkv.narrow(1, q_size + kv_size, kv_size).view({num_tokens, num_kv_heads, head_dim});
    at::Tensor key_cache = kv_caches.select(0, layer).select(0, 0);
    at::Tensor value_cache = kv_caches.select(0, layer).select(0, 1);
    at::Tensor attended = at::empty({num_tokens, num_heads, head_dim}, x.options());
    timed(attention_seconds, [&] {
      reshape_and_cache_cpu(k, v, key_cache, value_cache, slot_mapping);
      paged_attention_cpu(attended, q, key_cache, value_cache, block_tables, seq_lens,
                          query_start_loc, scale);
    });
    delta = linear(attended.view({num_tokens, q_size}), w[kOut], std::nullopt, hidden);
    std::tie(residual, h) = add_rms_norm_cpu(residual, delta, w[kPostNorm], eps);
    const at::Tensor gate_up = linear(h, w[kGateUp], std::nullopt, 2 * intermediate);
    delta = linear(silu_mul_cpu(gate_up), w[kDown], std::nullopt, hidden);
  }
  return std::get<1>(add_rms_norm_cpu(residual, delta, final_norm, eps));
}

}  // namespace pagedgen_cpu

TORCH_LIBRARY(pagedgen_cpu_decoder, m) {
  m.def(
      "forward(Tensor(a!) x, Tensor[] layer_weights, Tensor[] qkv_biases, Tensor[] qk_norms, "
      "Tensor final_norm, "
      "Tensor(b!) kv_caches, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, "
      "Tensor query_start_loc, Tensor cos, Tensor sin, int num_heads, int num_kv_heads, "
      "int head_dim, int intermediate_size, float eps, float scale, Tensor(c!)? timings=None) -> "
      "Tensor");
}

TORCH_LIBRARY_IMPL(pagedgen_cpu_decoder, CPU, m) {
  m.impl("forward", &pagedgen_cpu::decoder_forward);
}
