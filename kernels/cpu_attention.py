"""The CPU kernels (kernels/csrc/paged_attention_cpu.cpp) behind the same call signatures as
kernels.reference, which stays their test oracle."""

import torch

from kernels import reference


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = padding (skipped)
) -> None:
    """Write each token's K/V into its slot of the paged cache."""
    if key.dtype != key_cache.dtype or slot_mapping.dtype != torch.int64:
        # A conversion on the way in: the torch path handles it (the engine never needs it).
        reference.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
        return
    torch.ops.pagedgen_cpu.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    plan: object = None,  # the torch path's per-step plan; this kernel needs none
) -> torch.Tensor:
    """Causal attention of every query token over its sequence's paged context, reading the
    cache in place through the block tables. Returns [num_tokens, num_heads, head_size]."""
    if query.stride(-1) != 1 or query.stride(-2) != query.shape[-1]:
        query = query.contiguous()
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    torch.ops.pagedgen_cpu.paged_attention(
        out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale
    )
    return out
