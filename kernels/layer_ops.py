"""The small per-layer ops of a decoder step: RMSNorm (with the residual add before it),
Qwen3's RMSNorm of each q and k head, rotary embedding of q and k, SiLU(gate) * up.

`TORCH_LAYER_OPS` is the reference, in torch ops, with HF's order of operations (normalize in
float32, then scale; every product rounded to the model's dtype), used on CUDA and wherever the
C++ extension is missing; `CPU_LAYER_OPS` runs the same math fused, one pass per op
(kernels/csrc/layer_ops_cpu.cpp), and is tested against it.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LayerOps:
    # (x [rows, hidden], weight [hidden], eps) -> normed x
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    # (residual, delta, weight, eps) -> (residual + delta, its norm); may update residual
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # (qkv [rows, ...], cos, sin, num_heads, num_kv_heads, head_dim) -> (q, k), rotated
    rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # gate_up [rows, 2 * intermediate] -> silu(gate) * up [rows, intermediate]
    silu_mul: Callable[[torch.Tensor], torch.Tensor]
    # (qkv, q_weight [head_dim], k_weight [head_dim], num_heads, num_kv_heads, head_dim, eps):
    # each q head and k head of qkv RMS-normed in place (Qwen3's q_norm, k_norm)
    head_rms_norm: Callable[..., None]
    # rotary and the backend's reshape_and_cache in one op, where a backend fuses them:
    # (qkv, cos, sin, num_heads, num_kv_heads, head_dim, key_cache, value_cache, slot_mapping)
    # -> q; None: the model calls the two
    rotary_and_cache: Callable[..., torch.Tensor] | None = None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.float()
    inv_rms = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    # Row scaling through the transposed views: the same products, but a [T, 1] operand
    # broadcast along the contiguous dim is ~6x slower on CPU than along the outer one.
    x32 = (x32.t() * inv_rms.t()).t()
    return (weight * x32.to(dtype)).contiguous()


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    residual = residual + delta
    return residual, rms_norm(residual, weight, eps)


def head_rms_norm(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                  num_heads: int, num_kv_heads: int, head_dim: int, eps: float) -> None:
    """HF's RMSNorm over each head of q (q_weight) and of k (k_weight), written back into qkv
    (the projection's fresh output, read by nothing else yet)."""
    qk = qkv[:, : (num_heads + num_kv_heads) * head_dim].view(
        qkv.shape[0], num_heads + num_kv_heads, head_dim)
    for heads, weight in ((qk[:, :num_heads], q_weight), (qk[:, num_heads:], k_weight)):
        x32 = heads.float()
        inv_rms = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        heads.copy_(weight * (x32 * inv_rms).to(qkv.dtype))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
           num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    # q and k together, as one [tokens, heads + kv_heads, head_dim] tensor: the same
    # elementwise products as rotating each, in half the ops.
    qk = qkv[:, : (num_heads + num_kv_heads) * head_dim].view(
        qkv.shape[0], num_heads + num_kv_heads, head_dim)
    qk = qk * cos[:, None, :] + _rotate_half(qk) * sin[:, None, :]
    q, k = qk.split([num_heads, num_kv_heads], dim=1)
    return q, k


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


TORCH_LAYER_OPS = LayerOps(rms_norm=rms_norm, add_rms_norm=add_rms_norm, rotary=rotary,
                           silu_mul=silu_mul, head_rms_norm=head_rms_norm)


# Where torch's ops run instead of the fused ones: float16 above TORCH_ABOVE_ROWS rows (it
# converts through c10::Half per element, slower than torch past a few rows). bfloat16 and
# float32 run fused at every size: their loops vectorize, and the fused ops beat torch's from
# 1 row (3-10x) to 512 (1.2-4x), one thread. Fused at every size also keeps a row's result
# the same in every batch, which float32 relies on: with the CPU linear
# (kernels/csrc/linear_cpu.cpp), also batch-invariant, a float32 sequence computes the same
# bits alone or batched (tests/engine/test_preemption.py compares a seeded n=4 group
# preempted against a roomy pool bit for bit); torch's norms are not, and a mix failed it.
TORCH_ABOVE_ROWS = 8


def _torch_is_faster(x: torch.Tensor) -> bool:
    return x.dtype == torch.float16 and x.shape[0] > TORCH_ABOVE_ROWS


def _cpu_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _torch_is_faster(x):
        return rms_norm(x, weight, eps)
    return torch.ops.pagedgen_cpu_layer.rms_norm(x, weight, eps)


def _cpu_add_rms_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if _torch_is_faster(residual):
        return add_rms_norm(residual, delta, weight, eps)
    return torch.ops.pagedgen_cpu_layer.add_rms_norm(residual, delta, weight, eps)


def _cpu_rotary(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    if _torch_is_faster(qkv):
        return rotary(qkv, cos, sin, num_heads, num_kv_heads, head_dim)
    # In place: qkv is the projection's fresh output, read by nothing else.
    torch.ops.pagedgen_cpu_layer.rotary(qkv, cos, sin, num_heads + num_kv_heads, head_dim)
    rows = qkv.shape[0]
    q = qkv[:, : num_heads * head_dim].view(rows, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(
        rows, num_kv_heads, head_dim)
    return q, k


def _cpu_head_rms_norm(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                       num_heads: int, num_kv_heads: int, head_dim: int, eps: float) -> None:
    if _torch_is_faster(qkv):
        head_rms_norm(qkv, q_weight, k_weight, num_heads, num_kv_heads, head_dim, eps)
    else:
        torch.ops.pagedgen_cpu_layer.head_rms_norm(qkv, q_weight, k_weight, num_heads,
                                                   num_kv_heads, head_dim, eps)


def _cpu_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if _torch_is_faster(gate_up):
        return silu_mul(gate_up)
    return torch.ops.pagedgen_cpu_layer.silu_mul(gate_up)


CPU_LAYER_OPS = LayerOps(rms_norm=_cpu_rms_norm, add_rms_norm=_cpu_add_rms_norm,
                         rotary=_cpu_rotary, silu_mul=_cpu_silu_mul,
                         head_rms_norm=_cpu_head_rms_norm)
