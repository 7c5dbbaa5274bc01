// The CPU ops that kernels/csrc/decoder_cpu.cpp calls directly, without torch's dispatcher:
// each is also registered as a torch op by the file that defines it.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace pagedgen_cpu {

// paged_attention_cpu.cpp
void paged_attention_cpu(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                         const at::Tensor& value_cache, const at::Tensor& block_tables,
                         const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                         double scale);
void reshape_and_cache_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                           at::Tensor& value_cache, const at::Tensor& slot_mapping);

// layer_ops_cpu.cpp
at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm_cpu(at::Tensor residual, const at::Tensor& delta,
                                                    const at::Tensor& weight, double eps);
void head_rms_norm_cpu(at::Tensor qk, const at::Tensor& q_weight, const at::Tensor& k_weight,
                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps);
void rotary_cpu(at::Tensor qk, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
                int64_t head_dim);
at::Tensor silu_mul_cpu(const at::Tensor& gate_up);

// linear_cpu.cpp: float32, and bfloat16 handed to linear_bf16_cpu.cpp (by the weight's or
// x's dtype)
constexpr int64_t kFloatPanelColumns = 16;  // float32 packed [ceil(out / 16), in, 16]
at::Tensor pack_linear_weight(const at::Tensor& weight);
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed,
                         const std::optional<at::Tensor>& bias, int64_t out_features);

// linear_bf16_cpu.cpp
constexpr int64_t kBf16PanelColumns = 32;  // bf16 packed [ceil(out / 32), ceil(in / 2), 64]
bool linear_bf16_native();
at::Tensor pack_linear_weight_bf16(const at::Tensor& weight);
at::Tensor packed_linear_bf16(const at::Tensor& x, const at::Tensor& packed,
                              const std::optional<at::Tensor>& bias, int64_t out_features);

// linear_bf16_amx.cpp: the same packed weights on AMX tiles, which packed_linear_bf16 takes
// for every call where linear_bf16_amx() (built for AMX, and Linux granted the tiles)
bool linear_bf16_amx();
void packed_linear_bf16_amx(const uint16_t* x,  // [M, K] bf16 bits, rows ldx apart
                            int64_t ldx, int64_t M, int64_t K,
                            const uint16_t* packed,  // [panels, ceil(K / 2), 64] bf16 bits
                            int64_t panels,
                            uint16_t* y,  // [M, out_features] bf16 bits, dense
                            int64_t out_features,
                            const float* bias);  // [out_features] float32, or null

}  // namespace pagedgen_cpu
