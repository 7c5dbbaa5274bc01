"""Triton kernels that write the paged KV cache: reshape_and_cache and copy_blocks."""

import torch
import triton
import triton.language as tl

from kernels.launch_counter import count_launch
from kernels.triton_jit import jit

ROWS_PER_PROGRAM = 16  # (token, kv head) rows written by one reshape_and_cache program
MAX_COPY_CHUNK = 4096  # elements of one block copied by one copy_blocks program


@jit(do_not_specialize=["num_rows"])  # changes every step (see triton_jit)
def reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_size]
    value_ptr,  # [num_tokens, num_kv_heads, head_size]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping_ptr,  # [num_tokens] int64, block_id * block_size + offset, -1 = padding
    num_rows,  # num_tokens * num_kv_heads
    num_kv_heads,
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # next power of two >= HEAD_SIZE, masked
    BLOCK_SIZE: tl.constexpr,
    ROWS: tl.constexpr,  # tile: [ROWS (token, kv head) pairs, HEAD_PAD]
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    token = rows // num_kv_heads
    head = rows % num_kv_heads
    slot = tl.load(slot_mapping_ptr + token, mask=rows < num_rows, other=-1).to(tl.int64)
    row_valid = slot >= 0  # padding tokens (slot -1) are skipped
    # int64 slot: slot * stride overflows int32 once block ids pass 65,536.
    block_id = slot // BLOCK_SIZE
    slot_in_block = slot % BLOCK_SIZE
    dims = tl.arange(0, HEAD_PAD)
    mask = row_valid[:, None] & (dims < HEAD_SIZE)[None, :]

    key = tl.load(
        key_ptr + (token * stride_k_token + head * stride_k_head)[:, None] + dims[None, :],
        mask=mask,
    )
    key_dst = block_id * stride_kc_block + slot_in_block * stride_kc_slot + head * stride_kc_head
    tl.store(
        key_cache_ptr + key_dst[:, None] + dims[None, :],
        key.to(key_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    value = tl.load(
        value_ptr + (token * stride_v_token + head * stride_v_head)[:, None] + dims[None, :],
        mask=mask,
    )
    value_dst = block_id * stride_vc_block + slot_in_block * stride_vc_slot + head * stride_vc_head
    tl.store(
        value_cache_ptr + value_dst[:, None] + dims[None, :],
        value.to(value_cache_ptr.dtype.element_ty),
        mask=mask,
    )


@jit
def copy_blocks_kernel(
    kv_caches_ptr,  # [num_layers * 2, num_blocks, block_numel], contiguous
    block_mapping_ptr,  # [num_pairs, 2] int64: (src block, dst block)
    stride_cache,  # num_blocks * block_numel: one layer's K (or V) cache
    BLOCK_NUMEL: tl.constexpr,  # block_size * num_kv_heads * head_size
    CHUNK: tl.constexpr,  # elements per program, a power of two
):
    pair = tl.program_id(0)
    cache = tl.program_id(1).to(tl.int64)  # layer * 2 + (0 for K, 1 for V)
    chunk = tl.program_id(2)
    src = tl.load(block_mapping_ptr + pair * 2).to(tl.int64)
    dst = tl.load(block_mapping_ptr + pair * 2 + 1).to(tl.int64)
    elems = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = elems < BLOCK_NUMEL
    base = kv_caches_ptr + cache * stride_cache
    data = tl.load(base + src * BLOCK_NUMEL + elems, mask=mask)
    tl.store(base + dst * BLOCK_NUMEL + elems, data, mask=mask)


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = padding (skipped)
) -> None:
    """Write each token's K/V into its slot of the paged cache (Triton)."""
    num_tokens, num_kv_heads, head_size = key.shape
    if key_cache.shape[2:] != (num_kv_heads, head_size) or value_cache.shape != key_cache.shape:
        raise ValueError(
            f"key {tuple(key.shape)} does not fit key cache {tuple(key_cache.shape)} / value "
            f"cache {tuple(value_cache.shape)} ([num_blocks, block_size, {num_kv_heads}, "
            f"{head_size}] expected)"
        )
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens"
        )
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache),
                    ("value_cache", value_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_size, got strides {t.stride()}")
    num_rows = num_tokens * num_kv_heads
    if num_rows == 0:
        return
    count_launch("reshape_and_cache")
    reshape_and_cache_kernel[(triton.cdiv(num_rows, ROWS_PER_PROGRAM),)](
        key, value, key_cache, value_cache, slot_mapping, num_rows, num_kv_heads,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        HEAD_SIZE=head_size,
        HEAD_PAD=triton.next_power_of_2(head_size),
        BLOCK_SIZE=key_cache.shape[1],
        ROWS=ROWS_PER_PROGRAM,
    )


def copy_blocks(
    kv_caches: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_size]
    block_mapping: torch.Tensor,  # [num_pairs, 2] int64: (src block, dst block)
) -> None:
    """Copy whole blocks, in every layer, for K and V, in one launch (Triton).

    Pairs are applied as one parallel step, like the reference's indexed assignment: a block
    must not be both a source and a destination in the same call.
    """
    if block_mapping.numel() == 0:
        return
    if not kv_caches.is_contiguous():
        raise ValueError("kv_caches must be contiguous (it is one preallocated pool)")
    if block_mapping.dim() != 2 or block_mapping.shape[1] != 2:
        raise ValueError(f"block_mapping must be [num_pairs, 2], got {tuple(block_mapping.shape)}")
    num_layers, _, num_blocks = kv_caches.shape[:3]
    block_numel = kv_caches[0, 0, 0].numel()
    chunk = min(MAX_COPY_CHUNK, triton.next_power_of_2(block_numel))
    mapping = block_mapping.to(torch.int64).contiguous()
    grid = (mapping.shape[0], num_layers * 2, triton.cdiv(block_numel, chunk))
    count_launch("copy_blocks")
    copy_blocks_kernel[grid](
        kv_caches, mapping, num_blocks * block_numel, BLOCK_NUMEL=block_numel, CHUNK=chunk
    )
