// The small per-layer ops of a decoder step, fused for the CPU: RMSNorm (with the residual add
// before it), Qwen3's RMSNorm of each q and k head in place, rotary embedding of q and k in
// place, and SiLU(gate) * up.
//
// Why: at batch 1 a step of SmolLM2 runs ~45 torch ops per layer, and each costs a few
// microseconds of dispatch and allocation whatever its size (a row here is 576 numbers); that
// was a third of the step. Each op below replaces 4 to 12 of them with one pass over the rows.
//
// Rounding follows the torch code they replace (kernels/layer_ops.py, the reference they are
// tested against): norms accumulate in float32 and round to the tensor's dtype where torch
// would, products of two bf16 (fp16) tensors are rounded to bf16 (fp16) before the next op,
// and so on, so a model's numbers move only by the order of a float32 sum.
//
// Layouts: every tensor is [rows, features] with the feature dimension contiguous (rows may be
// strided: qkv slices). Rows run in parallel (at::parallel_for) when there are enough of them.
// The loops over a row are functions of their own: a pragma cannot sit inside AT_DISPATCH's
// macro argument.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "cpu_math.h"
#include "cpu_ops.h"

#include <cmath>
#include <cstdint>
#include <tuple>

namespace {

// Rows per parallel chunk: decode steps (a few rows) stay on the calling thread.
constexpr int64_t kRowGrain = 16;

using pagedgen_cpu::exp_approx;

template <typename T>
inline float widen(T x) {
  return pagedgen_cpu::to_float(x);
}

template <typename T>
inline T narrow(float x) {
  return pagedgen_cpu::from_float<T>(x);
}

// The value a float takes once stored as T (identity for float).
template <typename T>
inline float round_to(float x) {
  return widen(narrow<T>(x));
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2, name, " must be [rows, features], got ", t.dim(), " dims");
  TORCH_CHECK(t.stride(1) == 1, name, " must be contiguous in its last dimension");
}

// out = weight * (x * rsqrt(mean(x^2) + eps)).to(dtype), as HF's RMSNorm.
template <typename T>
inline void norm_row(const T* x, const T* weight, T* out, int64_t n, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    const float v = widen(x[i]);
    sum += v * v;
  }
  const float inv_rms = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    out[i] = narrow<T>(widen(weight[i]) * round_to<T>(widen(x[i]) * inv_rms));
  }
}

// row += delta, each sum rounded to T.
template <typename T>
inline void add_row(T* row, const T* delta, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    row[i] = narrow<T>(widen(row[i]) + widen(delta[i]));
  }
}

// x * cos + rotate_half(x) * sin over one head, in place; rotate_half(x) = [-hi, lo].
template <typename T>
inline void rotate_head(T* x, const T* c, const T* s, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float lo = widen(x[i]), hi = widen(x[i + half]);
    const float new_lo = round_to<T>(lo * widen(c[i])) + round_to<T>(-hi * widen(s[i]));
    const float new_hi =
        round_to<T>(hi * widen(c[i + half])) + round_to<T>(lo * widen(s[i + half]));
    x[i] = narrow<T>(new_lo);
    x[i + half] = narrow<T>(new_hi);
  }
}

// out = silu(gate) * up, silu rounded to T first.
template <typename T>
inline void silu_mul_row(const T* gate, const T* up, T* out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float g = widen(gate[i]);
    const float silu = round_to<T>(g / (1.f + exp_approx(-g)));
    out[i] = narrow<T>(silu * widen(up[i]));
  }
}

}  // namespace

namespace pagedgen_cpu {

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be contiguous, of x's dtype, with x.size(1) elements");
  auto out = at::empty(x.sizes(), x.options());
  const int64_t n = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const auto* xp = x.data_ptr<scalar_t>();
    const auto* wp = weight.data_ptr<scalar_t>();
    auto* op = out.data_ptr<scalar_t>();
    const int64_t stride = x.stride(0);
    at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        norm_row(xp + r * stride, wp, op + r * n, n, static_cast<float>(eps));
      }
    });
  });
  return out;
}

// residual += delta (rounded to dtype, as torch's add), then the norm of the new residual.
// Returns (residual, normed); residual is updated in place.
std::tuple<at::Tensor, at::Tensor> add_rms_norm_cpu(at::Tensor residual, const at::Tensor& delta,
                                                    const at::Tensor& weight, double eps) {
  check_rows(residual, "residual");
  check_rows(delta, "delta");
  TORCH_CHECK(residual.sizes() == delta.sizes() &&
                  residual.scalar_type() == delta.scalar_type(),
              "residual and delta must have one shape and dtype");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == residual.size(1) &&
                  weight.scalar_type() == residual.scalar_type(),
              "weight must be contiguous, of the residual's dtype and width");
  auto out = at::empty(residual.sizes(), residual.options());
  const int64_t n = residual.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, residual.scalar_type(), "add_rms_norm", [&] {
        auto* rp = residual.data_ptr<scalar_t>();
        const auto* dp = delta.data_ptr<scalar_t>();
        const auto* wp = weight.data_ptr<scalar_t>();
        auto* op = out.data_ptr<scalar_t>();
        const int64_t r_stride = residual.stride(0), d_stride = delta.stride(0);
        at::parallel_for(0, residual.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
          for (int64_t r = begin; r < end; ++r) {
            scalar_t* row = rp + r * r_stride;
            add_row(row, dp + r * d_stride, n);
            norm_row(row, wp, op + r * n, n, static_cast<float>(eps));
          }
        });
      });
  return std::make_tuple(residual, out);
}

// RMS-normalizes each head_dim-wide head of q (the first num_heads of each row of `qk`, with
// q_weight) and of k (the next num_kv_heads, with k_weight) in place: Qwen3's q_norm and
// k_norm, before the rotary. norm_row reads a head whole before it writes it.
void head_rms_norm_cpu(at::Tensor qk, const at::Tensor& q_weight, const at::Tensor& k_weight,
                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps) {
  check_rows(qk, "qk");
  TORCH_CHECK(num_heads >= 1 && num_kv_heads >= 1 && head_dim >= 1,
              "head_rms_norm: num_heads, num_kv_heads and head_dim must be >= 1");
  TORCH_CHECK(qk.size(1) >= (num_heads + num_kv_heads) * head_dim,
              "qk is narrower than (num_heads + num_kv_heads) * head_dim");
  for (const at::Tensor* w : {&q_weight, &k_weight}) {
    TORCH_CHECK(w->is_contiguous() && w->numel() == head_dim &&
                    w->scalar_type() == qk.scalar_type(),
                "q_weight and k_weight must be contiguous, of qk's dtype, with head_dim elements");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, qk.scalar_type(), "head_rms_norm", [&] {
    auto* xp = qk.data_ptr<scalar_t>();
    const auto* qw = q_weight.data_ptr<scalar_t>();
    const auto* kw = k_weight.data_ptr<scalar_t>();
    const int64_t stride = qk.stride(0);
    const float epsilon = static_cast<float>(eps);
    at::parallel_for(0, qk.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* row = xp + r * stride;
        for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
          scalar_t* head = row + h * head_dim;
          norm_row(head, h < num_heads ? qw : kw, head, head_dim, epsilon);
        }
      }
    });
  });
}

// Rotates the first `num_heads` head_dim-wide slices of each row of `qk` in place (q then k,
// side by side in the fused qkv projection): x * cos + rotate_half(x) * sin, each product
// rounded to dtype before the sum, as the torch code does.
void rotary_cpu(at::Tensor qk, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
                int64_t head_dim) {
  check_rows(qk, "qk");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  TORCH_CHECK(head_dim % 2 == 0, "head_dim must be even, got ", head_dim);
  TORCH_CHECK(qk.size(1) >= num_heads * head_dim, "qk is narrower than num_heads * head_dim");
  TORCH_CHECK(cos.size(0) == qk.size(0) && sin.size(0) == qk.size(0) &&
                  cos.size(1) == head_dim && sin.size(1) == head_dim,
              "cos and sin must be [rows, head_dim]");
  TORCH_CHECK(cos.scalar_type() == qk.scalar_type() && sin.scalar_type() == qk.scalar_type(),
              "cos and sin must have qk's dtype");
  const int64_t half = head_dim / 2;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qk.scalar_type(), "rotary", [&] {
    auto* qp = qk.data_ptr<scalar_t>();
    const auto* cp = cos.data_ptr<scalar_t>();
    const auto* sp = sin.data_ptr<scalar_t>();
    const int64_t q_stride = qk.stride(0), c_stride = cos.stride(0), s_stride = sin.stride(0);
    at::parallel_for(0, qk.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* c = cp + r * c_stride;
        const scalar_t* s = sp + r * s_stride;
        for (int64_t h = 0; h < num_heads; ++h) {
          rotate_head(qp + r * q_stride + h * head_dim, c, s, half);
        }
      }
    });
  });
}

// out = silu(gate) * up, gate and up the two halves of each row of gate_up.
at::Tensor silu_mul_cpu(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even width");
  const int64_t n = gate_up.size(1) / 2;
  auto out = at::empty({gate_up.size(0), n}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    const auto* gp = gate_up.data_ptr<scalar_t>();
    auto* op = out.data_ptr<scalar_t>();
    const int64_t stride = gate_up.stride(0);
    at::parallel_for(0, gate_up.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* gate = gp + r * stride;
        silu_mul_row(gate, gate + n, op + r * n, n);
      }
    });
  });
  return out;
}

}  // namespace pagedgen_cpu

TORCH_LIBRARY(pagedgen_cpu_layer, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def(
      "add_rms_norm(Tensor(a!) residual, Tensor delta, Tensor weight, float eps)"
      " -> (Tensor(a!), Tensor)");
  m.def("rotary(Tensor(a!) qk, Tensor cos, Tensor sin, int num_heads, int head_dim) -> ()");
  m.def(
      "head_rms_norm(Tensor(a!) qk, Tensor q_weight, Tensor k_weight, int num_heads, "
      "int num_kv_heads, int head_dim, float eps) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedgen_cpu_layer, CPU, m) {
  m.impl("rms_norm", &pagedgen_cpu::rms_norm_cpu);
  m.impl("add_rms_norm", &pagedgen_cpu::add_rms_norm_cpu);
  m.impl("rotary", &pagedgen_cpu::rotary_cpu);
  m.impl("head_rms_norm", &pagedgen_cpu::head_rms_norm_cpu);
  m.impl("silu_mul", &pagedgen_cpu::silu_mul_cpu);
}
