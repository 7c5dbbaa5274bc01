"""The per-layer ops of kernels/layer_ops.py as Triton kernels, one launch each: RMSNorm
(with the residual add before it, in place), Qwen3's RMSNorm of each q and k head (in place),
rotary embedding of q and k (in place on the qkv
projection; fused with the KV-cache write in the model's forward), SiLU(gate) * up. With them
a CUDA decode layer is 9-10 launches (2 norms, 4 linears, rotary with the cache write,
attention and its split combine, SiLU * up) instead of ~30 torch ops (issue 30).

The math is kernels/layer_ops.py's torch reference, rounding where it rounds: every product and
sum that torch computes in the model's dtype is computed in float32 and rounded to that dtype
at the same place, so bfloat16 results match torch's bit for bit except where a float32 sum
order (the norm's mean of squares) lands on the other side of a rounding edge.

Every wrapper reports its launch to kernels/launch_counter.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch_counter import count_launch
from kernels.layer_ops import LayerOps
from kernels.triton_jit import SUM_COMBINE, jit

# Rows of the norm and SiLU kernels per program: one row of up to 16K elements in registers.
MAX_NORM_WIDTH = 16384
SILU_COLUMNS = 1024  # columns of one SiLU * up program
ROTARY_HEADS = 4  # heads rotated by one program

@jit
def _rounded(x, dtype: tl.constexpr):
    """float32 `x` rounded to `dtype` (to nearest, ties to even), as float32. bfloat16 by hand:
    Triton's interpreter truncates float32 -> bfloat16 casts where a GPU rounds, and the same
    bits must come out of both (the CPU tests check the GPU's math)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dtype).to(tl.float32)


@jit(do_not_specialize=["num_rows"])
def _rms_norm_kernel(
    x_ptr,  # [rows, hidden]: the input, or the residual stream (updated in place with delta)
    delta_ptr,  # [rows, hidden], read only when HAS_DELTA
    weight_ptr,  # [hidden]
    out_ptr,  # [rows, hidden]
    num_rows,
    stride_x,
    stride_delta,
    stride_out,
    eps,
    HIDDEN: tl.constexpr,
    WIDTH: tl.constexpr,  # next power of two >= HIDDEN, masked
    HAS_DELTA: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, WIDTH)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    dtype = out_ptr.dtype.element_ty
    x32 = x.to(tl.float32)
    if HAS_DELTA:
        # residual + delta, rounded to the model's dtype as torch's add is, kept in place.
        delta = tl.load(delta_ptr + row * stride_delta + cols, mask=mask, other=0.0)
        x32 = _rounded(x32 + delta.to(tl.float32), dtype)
        tl.store(x_ptr + row * stride_x + cols, x32.to(dtype), mask=mask)
    mean_square = tl.reduce(x32 * x32, 0, SUM_COMBINE) / HIDDEN
    normed = _rounded(x32 * (1.0 / tl.sqrt(mean_square + eps)), dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # HF: weight * normed.to(dtype), one product rounded to the dtype.
    tl.store(out_ptr + row * stride_out + cols, _rounded(weight * normed, dtype).to(dtype),
             mask=mask)


def _norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
          eps: float) -> torch.Tensor:
    rows, hidden = x.shape
    if hidden > MAX_NORM_WIDTH or x.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError(f"rms_norm takes rows of at most {MAX_NORM_WIDTH} contiguous elements "
                         f"and a contiguous weight, got {tuple(x.shape)} strides {x.stride()}")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if rows == 0:
        return out
    has_delta = delta is not None
    if has_delta and delta.stride(1) != 1:
        delta = delta.contiguous()
    count_launch("add_rms_norm" if has_delta else "rms_norm")
    _rms_norm_kernel[(rows,)](
        x, delta if has_delta else x, weight, out, rows, x.stride(0),
        delta.stride(0) if has_delta else 0, out.stride(0), eps,
        HIDDEN=hidden, WIDTH=triton.next_power_of_2(hidden), HAS_DELTA=has_delta)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _norm(x, None, weight, eps)


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + delta, its norm); the residual is updated in place (the decoder's own
    stream: nothing else reads the old value)."""
    if residual.stride(1) != 1:
        residual = residual.contiguous()
    return residual, _norm(residual, delta, weight, eps)


@jit(do_not_specialize=["num_heads"])
def _head_rms_norm_kernel(
    qkv_ptr,  # [tokens, (heads + kv_heads + kv_heads) * head_dim]: q and k normed in place
    q_weight_ptr,  # [head_dim]
    k_weight_ptr,  # [head_dim]
    num_heads,  # q heads: program_id(1) below this is a q head, from it a k head
    stride_qkv,
    eps,
    HEAD_DIM: tl.constexpr,
    WIDTH: tl.constexpr,  # next power of two >= HEAD_DIM, masked
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    cols = tl.arange(0, WIDTH)
    mask = cols < HEAD_DIM
    at = qkv_ptr + token * stride_qkv + head * HEAD_DIM + cols
    x32 = tl.load(at, mask=mask, other=0.0).to(tl.float32)
    dtype = qkv_ptr.dtype.element_ty
    mean_square = tl.reduce(x32 * x32, 0, SUM_COMBINE) / HEAD_DIM
    normed = _rounded(x32 * (1.0 / tl.sqrt(mean_square + eps)), dtype)
    if head < num_heads:
        weight = tl.load(q_weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        weight = tl.load(k_weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(at, _rounded(weight * normed, dtype).to(dtype), mask=mask)


def head_rms_norm(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                  num_heads: int, num_kv_heads: int, head_dim: int, eps: float) -> None:
    """Each q head and k head of the projection's output RMS-normed in place (Qwen3)."""
    if (head_dim > MAX_NORM_WIDTH or qkv.stride(1) != 1 or not q_weight.is_contiguous()
            or not k_weight.is_contiguous()):
        raise ValueError(f"head_rms_norm takes heads of at most {MAX_NORM_WIDTH} contiguous "
                         f"elements and contiguous weights, got head_dim {head_dim}, qkv "
                         f"strides {qkv.stride()}")
    tokens = qkv.shape[0]
    if tokens:
        count_launch("head_rms_norm")
        _head_rms_norm_kernel[(tokens, num_heads + num_kv_heads)](
            qkv, q_weight, k_weight, num_heads, qkv.stride(0), eps, HEAD_DIM=head_dim,
            WIDTH=triton.next_power_of_2(head_dim))


@jit
def _rotated(x1, x2, cos_row, sin_row, dims, dim_ok, dtype: tl.constexpr, HALF: tl.constexpr):
    """The halves of x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1), for rows of
    heads (x1, x2: [heads, HALF_PAD] float32) at one token's cos / sin rows; each product and
    the sum rounded to the dtype as torch rounds them."""
    cos1 = tl.load(cos_row + dims, mask=dim_ok, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_row + HALF + dims, mask=dim_ok, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_row + dims, mask=dim_ok, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_row + HALF + dims, mask=dim_ok, other=0.0).to(tl.float32)
    out1 = _rounded(_rounded(x1 * cos1[None, :], dtype) + _rounded(-x2 * sin1[None, :], dtype),
                    dtype)
    out2 = _rounded(_rounded(x2 * cos2[None, :], dtype) + _rounded(x1 * sin2[None, :], dtype),
                    dtype)
    return out1, out2


@jit(do_not_specialize=["num_tokens"])
def _rotary_kernel(
    qkv_ptr,  # [tokens, (heads + kv_heads + kv_heads) * head_dim], rotated in place
    cos_ptr,  # [tokens, head_dim]
    sin_ptr,  # [tokens, head_dim]
    num_tokens,
    num_rotated_heads,  # heads + kv_heads: q and k, side by side
    stride_qkv,
    stride_cos,
    stride_sin,
    HALF: tl.constexpr,  # head_dim // 2
    HALF_PAD: tl.constexpr,  # next power of two >= HALF, masked
    HEADS: tl.constexpr,  # heads per program
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    dims = tl.arange(0, HALF_PAD)
    dim_ok = dims < HALF
    mask = (heads < num_rotated_heads)[:, None] & dim_ok[None, :]
    first = qkv_ptr + token * stride_qkv + (heads * 2 * HALF)[:, None] + dims[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = qkv_ptr.dtype.element_ty
    out1, out2 = _rotated(x1, x2, cos_ptr + token * stride_cos, sin_ptr + token * stride_sin,
                          dims, dim_ok, dtype, HALF)
    tl.store(first, out1.to(dtype), mask=mask)
    tl.store(first + HALF, out2.to(dtype), mask=mask)


def rotary(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
           num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated in place in the projection's output (read by nothing else); returns
    them as views of it."""
    if head_dim % 2 or qkv.stride(1) != 1 or cos.stride(1) != 1 or sin.stride(1) != 1:
        raise ValueError(f"rotary takes an even head_dim and rows of contiguous elements, got "
                         f"head_dim {head_dim}, qkv strides {qkv.stride()}")
    tokens = qkv.shape[0]
    rotated = num_heads + num_kv_heads
    if tokens:
        half = head_dim // 2
        count_launch("rotary")
        _rotary_kernel[(tokens, triton.cdiv(rotated, ROTARY_HEADS))](
            qkv, cos, sin, tokens, rotated, qkv.stride(0), cos.stride(0), sin.stride(0),
            HALF=half, HALF_PAD=triton.next_power_of_2(half), HEADS=ROTARY_HEADS)
    q = qkv[:, : num_heads * head_dim].view(tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : rotated * head_dim].view(tokens, num_kv_heads, head_dim)
    return q, k


@jit(do_not_specialize=["num_tokens"])
def _rotary_cache_kernel(
    qkv_ptr,  # [tokens, (heads + 2 * kv_heads) * head_dim]: q and k rotated in place
    cos_ptr,  # [tokens, head_dim]
    sin_ptr,  # [tokens, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, kv_heads, head_dim]
    slot_mapping_ptr,  # [tokens] int64, block_id * block_size + offset, -1 = padding
    num_tokens,
    num_heads,
    num_kv_heads,
    stride_qkv,
    stride_cos,
    stride_sin,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    HALF: tl.constexpr,  # head_dim // 2
    HALF_PAD: tl.constexpr,
    HEADS: tl.constexpr,  # heads (of q, k and v together) per program
    BLOCK_SIZE: tl.constexpr,
):
    """rotary's math on q and k, then k (rotated) and v written into their cache slot: the
    two kernels of an attention layer's input in one pass over the projection."""
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)  # over q, then k, then v heads
    dims = tl.arange(0, HALF_PAD)
    dim_ok = dims < HALF
    num_qk = num_heads + num_kv_heads
    is_v = heads >= num_qk
    is_k = (heads >= num_heads) & (heads < num_qk)
    valid = (heads < num_qk + num_kv_heads)[:, None] & dim_ok[None, :]
    first = qkv_ptr + token * stride_qkv + (heads * 2 * HALF)[:, None] + dims[None, :]
    x1 = tl.load(first, mask=valid, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=valid, other=0.0).to(tl.float32)
    dtype = qkv_ptr.dtype.element_ty
    out1, out2 = _rotated(x1, x2, cos_ptr + token * stride_cos, sin_ptr + token * stride_sin,
                          dims, dim_ok, dtype, HALF)
    rotated = valid & (heads < num_qk)[:, None]
    tl.store(first, out1.to(dtype), mask=rotated)
    tl.store(first + HALF, out2.to(dtype), mask=rotated)
    # k rotated, v as it is: into the token's slot (none for a padding token).
    # The slot once per head (a vector, not a scalar: masks stay [HEADS, HALF_PAD] tensors;
    # heads * 0, not tl.zeros, a standard-library jit function: see kernels/triton_jit.py).
    slot = tl.load(slot_mapping_ptr + token + heads * 0).to(tl.int64)
    cached = valid & (slot >= 0)[:, None]
    block_id = (slot // BLOCK_SIZE)[:, None]
    in_block = (slot % BLOCK_SIZE)[:, None]
    k_head = (heads - num_heads).to(tl.int64)
    k_dst = (key_cache_ptr + block_id * stride_kc_block + in_block * stride_kc_slot
             + (k_head * stride_kc_head)[:, None] + dims[None, :])
    k_mask = cached & is_k[:, None]
    cache_dtype = key_cache_ptr.dtype.element_ty
    tl.store(k_dst, out1.to(dtype).to(cache_dtype), mask=k_mask)
    tl.store(k_dst + HALF, out2.to(dtype).to(cache_dtype), mask=k_mask)
    v_head = (heads - num_qk).to(tl.int64)
    v_dst = (value_cache_ptr + block_id * stride_vc_block + in_block * stride_vc_slot
             + (v_head * stride_vc_head)[:, None] + dims[None, :])
    v_mask = cached & is_v[:, None]
    value_dtype = value_cache_ptr.dtype.element_ty
    tl.store(v_dst, x1.to(dtype).to(value_dtype), mask=v_mask)
    tl.store(v_dst + HALF, x2.to(dtype).to(value_dtype), mask=v_mask)


def rotary_and_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                     num_kv_heads: int, head_dim: int, key_cache: torch.Tensor,
                     value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """rotary (q and k in place) and reshape_and_cache (k and v into their slots) in one
    launch; returns q, a view of the projection."""
    if head_dim % 2 or qkv.stride(1) != 1 or cos.stride(1) != 1 or sin.stride(1) != 1:
        raise ValueError(f"rotary takes an even head_dim and rows of contiguous elements, got "
                         f"head_dim {head_dim}, qkv strides {qkv.stride()}")
    expected = (num_kv_heads, head_dim)
    if (key_cache.shape[2:] != expected or value_cache.shape != key_cache.shape
            or key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1):
        raise ValueError(f"key and value caches must be [num_blocks, block_size, "
                         f"{num_kv_heads}, {head_dim}], contiguous in head_dim, got "
                         f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    tokens = qkv.shape[0]
    if slot_mapping.shape[0] != tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {tokens} tokens")
    if tokens:
        half = head_dim // 2
        count_launch("rotary_and_cache")
        _rotary_cache_kernel[(tokens, triton.cdiv(num_heads + 2 * num_kv_heads, ROTARY_HEADS))](
            qkv, cos, sin, key_cache, value_cache, slot_mapping, tokens, num_heads, num_kv_heads,
            qkv.stride(0), cos.stride(0), sin.stride(0),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
            HALF=half, HALF_PAD=triton.next_power_of_2(half), HEADS=ROTARY_HEADS,
            BLOCK_SIZE=key_cache.shape[1])
    return qkv[:, : num_heads * head_dim].view(tokens, num_heads, head_dim)


@jit(do_not_specialize=["num_rows"])
def _silu_mul_kernel(
    gate_up_ptr,  # [rows, 2 * width]: gate then up
    out_ptr,  # [rows, width]
    num_rows,
    width,
    stride_in,
    stride_out,
    COLUMNS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * COLUMNS + tl.arange(0, COLUMNS)
    mask = cols < width
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + width + cols, mask=mask,
                 other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    # torch: silu(gate) rounded to the dtype, then one product rounded again.
    silu = _rounded(gate / (1.0 + tl.exp(-gate)), dtype)
    tl.store(out_ptr + row * stride_out + cols, _rounded(silu * up, dtype).to(dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    rows, double = gate_up.shape
    if double % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"silu_mul takes rows of even width, contiguous, got "
                         f"{tuple(gate_up.shape)} strides {gate_up.stride()}")
    width = double // 2
    out = torch.empty((rows, width), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        count_launch("silu_mul")
        _silu_mul_kernel[(rows, triton.cdiv(width, SILU_COLUMNS))](
            gate_up, out, rows, width, gate_up.stride(0), out.stride(0), COLUMNS=SILU_COLUMNS)
    return out


TRITON_LAYER_OPS = LayerOps(rms_norm=rms_norm, add_rms_norm=add_rms_norm, rotary=rotary,
                            silu_mul=silu_mul, head_rms_norm=head_rms_norm,
                            rotary_and_cache=rotary_and_cache)
JIT_KERNELS = {"rms_norm": _rms_norm_kernel, "head_rms_norm": _head_rms_norm_kernel,
               "rotary": _rotary_kernel,
               "rotary_and_cache": _rotary_cache_kernel, "silu_mul": _silu_mul_kernel}
