"""Torch implementations of the paged KV-cache kernels.

These are the reference the Triton kernels are tested against, and the fast path on the CPU:
every operation is a batched gather through the block tables followed by one attention call,
with no Python loop over tokens or blocks.

Layouts (shared with the Triton kernels):
    query        [num_tokens, num_heads, head_size]        all scheduled tokens, flattened
    key_cache    [num_blocks, block_size, num_kv_heads, head_size]
    value_cache  [num_blocks, block_size, num_kv_heads, head_size]
    block_tables [num_seqs, max_blocks_per_seq] int32       logical -> physical block ids
    seq_lens     [num_seqs] int32                           context length incl. the new tokens
    query_start_loc [num_seqs + 1] int32                    cumulative query lengths
    slot_mapping [num_tokens] int64                         block_id * block_size + offset, -1 = pad
    kv_caches    [num_layers, 2, num_blocks, block_size, num_kv_heads, head_size]
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = padding (skipped)
) -> None:
    """Write each token's K/V into its slot of the paged cache."""
    num_kv_heads, head_size = key_cache.shape[2], key_cache.shape[3]
    flat_key_cache = key_cache.view(-1, num_kv_heads, head_size)
    flat_value_cache = value_cache.view(-1, num_kv_heads, head_size)
    slots = slot_mapping.long()
    valid = slots >= 0
    if not bool(valid.all()):
        slots, key, value = slots[valid], key[valid], value[valid]
    flat_key_cache.index_copy_(0, slots, key.to(key_cache.dtype))
    flat_value_cache.index_copy_(0, slots, value.to(value_cache.dtype))


def copy_blocks(
    kv_caches: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_size]
    block_mapping: torch.Tensor,  # [num_pairs, 2] int64: (src block, dst block)
) -> None:
    """Copy whole blocks, in every layer, for K and V (copy-on-write of shared blocks)."""
    if block_mapping.numel() == 0:
        return
    src = block_mapping[:, 0].long()
    dst = block_mapping[:, 1].long()
    # index_copy_ of an index_select: measured faster on CPU than advanced-index assignment.
    kv_caches.index_copy_(2, dst, kv_caches.index_select(2, src))


@dataclass
class AttentionPlan:
    """Index tensors derived from one step's metadata, built once and reused by every layer.

    Sequences are split into a decode group (one query token) and a prefill group (a chunk of
    query tokens), so a long prefill chunk does not pad every decode query to its length.
    """

    decode_seqs: torch.Tensor  # [num_decode] int64 sequence indices
    decode_tokens: torch.Tensor  # [num_decode] int64 token indices into query
    prefill_seqs: torch.Tensor  # [num_prefill] int64
    prefill_token_index: torch.Tensor  # [num_prefill, max_query_len] int64 (clamped for padding)
    prefill_token_valid: torch.Tensor  # [num_prefill, max_query_len] bool
    # [num_prefill, 1, max_query_len, prefill_ctx] bool, True = attend; None when every prefill
    # starts at position 0, where a plain causal mask is exact and lets the kernel skip the
    # upper triangle (padded query rows past a sequence's end are dropped).
    prefill_mask: torch.Tensor | None
    decode_mask: torch.Tensor  # [num_decode, 1, 1, decode_ctx] bool
    decode_num_blocks: int
    prefill_num_blocks: int
    # Block tables of each group as int64, trimmed to the blocks in use (gather indices).
    decode_tables: torch.Tensor  # [num_decode, decode_num_blocks]
    prefill_tables: torch.Tensor  # [num_prefill, prefill_num_blocks]
    decode_only: bool  # every query is one token: no index/scatter of query and output


def build_attention_plan(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_size: int,
) -> AttentionPlan:
    """Precompute the gather indices and masks for one batch (see AttentionPlan)."""
    device = block_tables.device
    seq_lens = seq_lens.long()
    query_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    is_decode = query_lens == 1
    decode_seqs = torch.nonzero(is_decode).flatten()
    prefill_seqs = torch.nonzero(~is_decode).flatten()

    decode_lens = seq_lens[decode_seqs]
    decode_ctx = int(decode_lens.max()) if decode_seqs.numel() else 0
    decode_num_blocks = -(-decode_ctx // block_size)
    key_pos = torch.arange(decode_num_blocks * block_size, device=device)
    decode_mask = (key_pos[None, :] < decode_lens[:, None])[:, None, None, :]

    p_query_lens = query_lens[prefill_seqs]
    p_seq_lens = seq_lens[prefill_seqs]
    max_q = int(p_query_lens.max()) if prefill_seqs.numel() else 0
    prefill_ctx = int(p_seq_lens.max()) if prefill_seqs.numel() else 0
    prefill_num_blocks = -(-prefill_ctx // block_size)
    q_pos = torch.arange(max_q, device=device)
    token_valid = q_pos[None, :] < p_query_lens[:, None]
    token_index = query_start_loc[prefill_seqs].long()[:, None] + q_pos[None, :]
    # Padded query rows gather token 0, which every batch has: a sequence with no query tokens
    # (a padding row of the mixed-step graphs' buffers) may start past the last token.
    token_index = torch.where(token_valid, token_index, 0)
    # Absolute position of each query token; it sees keys at positions <= its own.
    abs_q_pos = (p_seq_lens - p_query_lens)[:, None] + q_pos[None, :]
    k_pos = torch.arange(prefill_num_blocks * block_size, device=device)
    prefill_mask = k_pos[None, None, :] <= abs_q_pos[:, :, None]
    # Padded query rows attend to key 0 only, so they stay finite (their output is dropped).
    prefill_mask = prefill_mask & token_valid[:, :, None] | (k_pos == 0)[None, None, :]
    prefill_mask = prefill_mask[:, None]
    if bool((p_seq_lens == p_query_lens).all()):
        prefill_mask = None
    return AttentionPlan(
        decode_seqs=decode_seqs,
        decode_tokens=query_start_loc[decode_seqs].long(),
        prefill_seqs=prefill_seqs,
        prefill_token_index=token_index,
        prefill_token_valid=token_valid,
        prefill_mask=prefill_mask,
        decode_mask=decode_mask,
        decode_num_blocks=decode_num_blocks,
        prefill_num_blocks=prefill_num_blocks,
        decode_tables=block_tables[decode_seqs, :decode_num_blocks].long(),
        prefill_tables=block_tables[prefill_seqs, :prefill_num_blocks].long(),
        decode_only=prefill_seqs.numel() == 0,
    )


def _gather_context(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """[num_seqs, num_kv_heads, num_blocks * block_size, head_size] through the block tables
    (int64 [num_seqs, num_blocks])."""
    gathered = cache[tables]  # [S, nb, bs, kvh, D]
    s, nb, bs, kvh, d = gathered.shape
    return gathered.view(s, nb * bs, kvh, d).transpose(1, 2)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """Causal attention of every query token over its sequence's paged context.

    Query token i of a sequence with q new tokens and context length L sits at position
    L - q + i and attends to keys 0 .. L - q + i. Returns [num_tokens, num_heads, head_size].
    """
    if plan is None:
        plan = build_attention_plan(block_tables, seq_lens, query_start_loc, key_cache.shape[1])
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[2]
    gqa = num_heads != num_kv_heads
    out = query if plan.decode_only else torch.empty_like(query)

    if plan.decode_seqs.numel():
        k = _gather_context(key_cache, plan.decode_tables).to(query.dtype)
        v = _gather_context(value_cache, plan.decode_tables).to(query.dtype)
        # The query heads sharing a KV head become that head's "query rows": one attention
        # call over [S, num_kv_heads, group, D] with no GQA expansion of K/V (measured ~1.7x
        # faster on CPU than enable_gqa with one query row per head).
        group = num_heads // num_kv_heads
        decode_query = query if plan.decode_only else query[plan.decode_tokens]
        q = decode_query.reshape(-1, num_kv_heads, group, head_size)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.decode_mask, scale=scale)
        if plan.decode_only:
            return o.reshape(num_tokens, num_heads, head_size)
        out[plan.decode_tokens] = o.reshape(-1, num_heads, head_size)

    if plan.prefill_seqs.numel():
        k = _gather_context(key_cache, plan.prefill_tables).to(query.dtype)
        v = _gather_context(value_cache, plan.prefill_tables).to(query.dtype)
        q = query[plan.prefill_token_index].transpose(1, 2)  # [S, H, Qmax, D]
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=plan.prefill_mask, scale=scale, enable_gqa=gqa,
            is_causal=plan.prefill_mask is None,
        )
        o = o.transpose(1, 2)  # [S, Qmax, H, D]
        valid = plan.prefill_token_valid
        out[plan.prefill_token_index[valid]] = o[valid]
    return out
