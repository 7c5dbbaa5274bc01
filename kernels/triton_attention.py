"""Paged attention in Triton: one kernel family for mixed prefill + decode batches.

Each program owns a tile of query rows for one KV head: BLOCK_Q consecutive query tokens of one
sequence times the QUERIES_PER_KV query heads that share that KV head (GQA), so K/V are read
once per group instead of once per query head. It walks the sequence's keys in tiles of TILE_N
positions through the block table with an online softmax (running max, running sum).

Split-KV (flash-decoding): with few sequences the (query tile, KV head) grid is too small to
fill a GPU, so a third grid axis splits each sequence's key range into NUM_SPLITS parts; each
writes an unnormalised partial (acc, max, sum) and `_combine_splits_kernel` merges them.

Programs are indexed without a host sync: query tile b belongs to the last sequence i with
query_start_loc[i] // BLOCK_Q + i <= b (binary search in the kernel), which over-counts by at
most one tile per sequence; surplus tiles exit at once.
"""

import torch
import triton
import triton.language as tl

from kernels.launch_counter import count_launch
from kernels.triton_jit import INTERPRETED, MAX_COMBINE, SUM_COMBINE, jit

LOG2_E = 1.4426950408889634
MIN_DOT_ROWS = 16  # tl.dot needs at least 16 rows / columns on NVIDIA GPUs
MAX_KV_SPLITS = 16
MIN_KEYS_PER_SPLIT = 256  # below this a split costs more in the combine step than it saves


@jit
def _find_sequence(
    query_start_loc_ptr,  # [num_seqs + 1] int32
    num_seqs,
    tile_index,
    BLOCK_Q: tl.constexpr,
):
    """Binary search: the last sequence i whose first query tile index is <= tile_index."""
    lo = tile_index * 0  # a tensor, not a constexpr, so the loop can carry it
    hi = lo + num_seqs  # the answer lies in [lo, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(first_tile <= tile_index, mid, lo)
        hi = tl.where(first_tile <= tile_index, hi, mid)
    return lo


# Per-step integers: a variant compiled for one value must serve every step (see triton_jit).
ATTENTION_PER_STEP_ARGS = ("num_seqs", "stride_table_seq")


@jit(do_not_specialize=ATTENTION_PER_STEP_ARGS)
def paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_size]                (NUM_SPLITS == 1)
    partial_acc_ptr,  # [num_tokens, num_heads, NUM_SPLITS, HEAD_PAD] fp32 (NUM_SPLITS > 1)
    partial_max_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32, log2 domain
    partial_sum_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32
    query_ptr,  # [num_tokens, num_heads, head_size]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32, context length incl. the new tokens
    query_start_loc_ptr,  # [num_seqs + 1] int32
    scale_log2,  # softmax scale * log2(e): scores live in the log2 domain (exp2 is cheaper)
    num_seqs,
    stride_q_token,
    stride_q_head,
    stride_o_token,
    stride_o_head,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_v_block,
    stride_v_slot,
    stride_v_head,
    stride_table_seq,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # next power of two >= HEAD_SIZE (80, 96 -> 128), masked
    BLOCK_SIZE: tl.constexpr,  # tokens per KV cache block
    TILE_N: tl.constexpr,  # key positions per loop step (any power of two; may span blocks)
    BLOCK_M: tl.constexpr,  # query rows per program = BLOCK_Q tokens x QUERIES_PER_KV heads
    BLOCK_Q: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 (no silent tf32), else the default
    DOT_IN_FP32: tl.constexpr,  # upcast dot operands (the interpreter cannot multiply bf16)
):
    tile_index = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_sequence(query_start_loc_ptr, num_seqs, tile_index, BLOCK_Q)
    q_tile_in_seq = tile_index - (tl.load(query_start_loc_ptr + seq) // BLOCK_Q + seq)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile_in_seq * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    num_cached = seq_len - q_len  # query token i sits at position num_cached + i

    # Query rows: row r is token (r // QUERIES_PER_KV) of the tile, head (r % QUERIES_PER_KV)
    # of the group; rows past BLOCK_Q * QUERIES_PER_KV pad BLOCK_M up to a power of two.
    rows = tl.arange(0, BLOCK_M)
    q_in_seq = q_tile_in_seq * BLOCK_Q + rows // QUERIES_PER_KV  # [BLOCK_M]
    head = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV  # [BLOCK_M]
    row_valid = (rows < BLOCK_Q * QUERIES_PER_KV) & (q_in_seq < q_len)
    q_pos = num_cached + q_in_seq  # [BLOCK_M] absolute positions
    token = (q_start + q_in_seq).to(tl.int64)
    dims = tl.arange(0, HEAD_PAD)
    dim_valid = dims < HEAD_SIZE

    q_offsets = token[:, None] * stride_q_token + head[:, None] * stride_q_head + dims[None, :]
    q = tl.load(
        query_ptr + q_offsets, mask=row_valid[:, None] & dim_valid[None, :], other=0.0
    )  # [BLOCK_M, HEAD_PAD]
    if DOT_IN_FP32:
        q = q.to(tl.float32)

    # Keys this tile needs: 0 .. last valid query position (causal), split evenly by tiles.
    last_q_in_seq = tl.minimum((q_tile_in_seq + 1) * BLOCK_Q, q_len) - 1
    num_keys = num_cached + last_q_in_seq + 1
    num_kv_tiles = (num_keys + TILE_N - 1) // TILE_N
    tiles_per_split = (num_kv_tiles + NUM_SPLITS - 1) // NUM_SPLITS
    first_kv_tile = split * tiles_per_split
    end_kv_tile = tl.minimum(first_kv_tile + tiles_per_split, num_kv_tiles)

    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, HEAD_PAD], 0.0, tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table_seq
    for kv_tile in range(first_kv_tile, end_kv_tile):
        key_pos = kv_tile * TILE_N + tl.arange(0, TILE_N)  # [TILE_N]
        key_valid = key_pos < num_keys
        # int64 before the stride multiply: block ids past 65,536 overflow int32 offsets.
        block_id = tl.load(table_row + key_pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        slot_in_block = (key_pos % BLOCK_SIZE).to(tl.int64)
        k_offsets = block_id * stride_k_block + slot_in_block * stride_k_slot
        v_offsets = block_id * stride_v_block + slot_in_block * stride_v_slot
        kv_mask = key_valid[None, :] & dim_valid[:, None]
        k = tl.load(
            key_cache_ptr + k_offsets[None, :] + kv_head * stride_k_head + dims[:, None],
            mask=kv_mask,
            other=0.0,
        )  # [HEAD_PAD, TILE_N]
        v = tl.load(
            value_cache_ptr + v_offsets[:, None] + kv_head * stride_v_head + dims[None, :],
            mask=tl.trans(kv_mask),
            other=0.0,
        )  # [TILE_N, HEAD_PAD]
        k = k.to(q.dtype)  # the reference also casts the cache to the query dtype
        v = v.to(q.dtype)

        scores = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, TILE_N]
        visible = (key_pos[None, :] <= q_pos[:, None]) & key_valid[None, :]
        scores = tl.where(visible, scores, float("-inf"))

        new_max = tl.maximum(running_max, tl.reduce(scores, 1, MAX_COMBINE))
        # A row that has seen no visible key yet keeps max -inf; shift by 0 so exp2 gives 0,
        # not NaN from (-inf) - (-inf).
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.exp2(scores - shift[:, None])
        rescale = tl.exp2(running_max - shift)
        running_sum = running_sum * rescale + tl.reduce(probs, 1, SUM_COMBINE)
        acc = acc * rescale[:, None] + tl.dot(
            probs.to(q.dtype), v, input_precision=DOT_PRECISION
        )
        running_max = new_max

    out_mask = row_valid[:, None] & dim_valid[None, :]
    if NUM_SPLITS == 1:
        # Padded rows may have sum 0; divide by 1 there (their store is masked anyway).
        out = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
        o_offsets = token[:, None] * stride_o_token + head[:, None] * stride_o_head + dims[None, :]
        tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Partial buffers are contiguous; an empty split stores (0, -inf, 0), which the combine
        # step weights by exp2(-inf) = 0.
        row_id = (token * (QUERIES_PER_KV * tl.num_programs(1)) + head) * NUM_SPLITS + split
        tl.store(partial_max_ptr + row_id, running_max, mask=row_valid)
        tl.store(partial_sum_ptr + row_id, running_sum, mask=row_valid)
        tl.store(partial_acc_ptr + row_id[:, None] * HEAD_PAD + dims[None, :], acc, mask=out_mask)


@jit
def _combine_splits_kernel(
    out_ptr,  # [num_tokens, num_heads, head_size]
    partial_acc_ptr,  # [num_tokens, num_heads, NUM_SPLITS, HEAD_PAD] fp32
    partial_max_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32, log2 domain
    partial_sum_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32
    stride_o_token,
    stride_o_head,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = token * tl.num_programs(1) + head
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, HEAD_PAD)
    split_max = tl.load(partial_max_ptr + row * NUM_SPLITS + splits)  # [NUM_SPLITS]
    split_sum = tl.load(partial_sum_ptr + row * NUM_SPLITS + splits)
    split_acc = tl.load(
        partial_acc_ptr + (row * NUM_SPLITS + splits)[:, None] * HEAD_PAD + dims[None, :]
    )  # [NUM_SPLITS, HEAD_PAD]
    # Split 0 always holds key 0, which every query sees, so the global max is finite.
    global_max = tl.reduce(split_max, 0, MAX_COMBINE)
    weight = tl.exp2(split_max - global_max)  # 0 for empty splits
    total = tl.reduce(split_sum * weight, 0, SUM_COMBINE)
    out = tl.reduce(split_acc * weight[:, None], 0, SUM_COMBINE) / total
    tl.store(
        out_ptr + token * stride_o_token + head * stride_o_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_SIZE,
    )


def kv_splits_for(num_seqs: int, num_kv_heads: int, max_context_bound: int, num_sms: int) -> int:
    """Splits per sequence of a decode batch: they grow until the grid has about two programs
    per SM or each split would see fewer than MIN_KEYS_PER_SPLIT keys."""
    programs = max(1, num_seqs * num_kv_heads)
    splits = 1
    while (
        splits < MAX_KV_SPLITS
        and programs * splits * 2 <= 2 * num_sms
        and max_context_bound // (splits * 2) >= MIN_KEYS_PER_SPLIT
    ):
        splits *= 2
    return splits


def reachable_kv_splits(
    max_num_seqs: int, num_kv_heads: int, max_context_bound: int, num_sms: int
) -> list[int]:
    """Every split count `kv_splits_for` can return for batches of 1..max_num_seqs sequences
    and context bounds up to max_context_bound: the NUM_SPLITS variants a warm-up compiles.

    Fewer sequences never mean fewer splits, and the count only grows with the context bound,
    so one sequence at each bound where a doubling starts to pass covers every value.
    """
    bounds = [MIN_KEYS_PER_SPLIT * 2 * s for s in range(1, MAX_KV_SPLITS + 1)]
    bounds = [b for b in bounds if b <= max_context_bound] + [max_context_bound]
    found = {kv_splits_for(1, num_kv_heads, b, num_sms) for b in bounds}
    found |= {kv_splits_for(max_num_seqs, num_kv_heads, max_context_bound, num_sms), 1}
    return sorted(found)


def choose_num_kv_splits(
    num_seqs: int,
    num_tokens: int,
    num_kv_heads: int,
    max_context_bound: int,
    device: torch.device,
) -> int:
    """Splits per sequence for split-KV, from host-known shapes only (no device sync).

    Only decode batches split (prefill tiles already give enough parallelism) and only on a
    GPU (in the interpreter, more programs just cost more time).
    """
    if device.type != "cuda" or num_tokens != num_seqs:
        return 1
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    return kv_splits_for(num_seqs, num_kv_heads, max_context_bound, num_sms)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    plan: object | None = None,
    num_kv_splits: int | None = None,
) -> torch.Tensor:
    """Causal attention of every query token over its sequence's paged context (Triton).

    Same contract as `kernels.reference.paged_attention`. `plan` is accepted for interface
    compatibility and ignored (the kernel needs no precomputed indices). `num_kv_splits`
    forces the split-KV path (a power of two); None picks it from the shapes.
    """
    num_tokens, num_heads, head_size = query.shape
    num_blocks, block_size, num_kv_heads, cache_head_size = key_cache.shape
    num_seqs = block_tables.shape[0]
    _check_inputs(query, key_cache, value_cache, num_heads, num_kv_heads, head_size,
                  cache_head_size, query_start_loc, num_seqs)
    out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if num_kv_splits is None:
        num_kv_splits = choose_num_kv_splits(
            num_seqs, num_tokens, num_kv_heads, block_tables.shape[1] * block_size, query.device
        )
    if num_kv_splits < 1 or num_kv_splits & (num_kv_splits - 1):
        raise ValueError(f"num_kv_splits must be a power of two >= 1, got {num_kv_splits}")

    queries_per_kv = num_heads // num_kv_heads
    decode_only = num_tokens == num_seqs
    # Decode rows hold one token each, so a bigger tile would only add masked rows.
    # fp32 ("ieee") dots run on the FMA units with every operand in registers: a 64-row
    # mixed-batch tile needs over 255 registers per thread and spills, 32 rows do not.
    mixed_rows = 32 if query.dtype == torch.float32 else 64
    block_m = max(MIN_DOT_ROWS if decode_only else mixed_rows,
                  triton.next_power_of_2(queries_per_kv))
    block_q = block_m // queries_per_kv
    head_pad = max(16, triton.next_power_of_2(head_size))
    num_q_tiles = num_tokens // block_q + num_seqs  # upper bound, see module docstring
    if num_kv_splits > 1:
        partial_acc = torch.empty(
            (num_tokens, num_heads, num_kv_splits, head_pad), dtype=torch.float32,
            device=query.device,
        )
        partial_max = torch.empty(
            (num_tokens, num_heads, num_kv_splits), dtype=torch.float32, device=query.device
        )
        partial_sum = torch.empty_like(partial_max)
    else:
        partial_acc = partial_max = partial_sum = out  # unused (NUM_SPLITS == 1)
    count_launch("paged_attention")
    paged_attention_kernel[(num_q_tiles, num_kv_heads, num_kv_splits)](
        out, partial_acc, partial_max, partial_sum,
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        scale * LOG2_E, num_seqs,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        QUERIES_PER_KV=queries_per_kv,
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size,
        TILE_N=max(32, triton.next_power_of_2(block_size)),
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        NUM_SPLITS=num_kv_splits,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        DOT_IN_FP32=INTERPRETED and torch.bfloat16 in (query.dtype, key_cache.dtype),
        num_warps=_num_warps(query.dtype, head_pad),
    )
    if num_kv_splits > 1:
        count_launch("combine_splits")
        _combine_splits_kernel[(num_tokens, num_heads)](
            out, partial_acc, partial_max, partial_sum, out.stride(0), out.stride(1),
            HEAD_SIZE=head_size, HEAD_PAD=head_pad, NUM_SPLITS=num_kv_splits,
        )
    return out


def _num_warps(dtype: torch.dtype, head_pad: int) -> int:
    """16-bit tiles run their dots on tensor cores and fit 4 warps. fp32 tiles hold their dot
    operands in registers: spread over 8 warps, or 16 from 128 padded dims, no variant spills
    (measured with ptxas for sm_80 and sm_90; tests/kernels/test_kernel_cuda_compile.py checks
    every variant)."""
    if dtype != torch.float32:
        return 4
    return 16 if head_pad >= 128 else 8


def _check_inputs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    cache_head_size: int,
    query_start_loc: torch.Tensor,
    num_seqs: int,
) -> None:
    if num_heads % num_kv_heads:
        raise ValueError(
            f"query heads ({num_heads}) must be a multiple of KV heads ({num_kv_heads})"
        )
    if head_size != cache_head_size:
        raise ValueError(f"query head size {head_size} != KV cache head size {cache_head_size}")
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"value cache {tuple(value_cache.shape)} != key cache "
                         f"{tuple(key_cache.shape)}")
    for name, t in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_size, got strides {t.stride()}")
    if query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(f"query_start_loc must have num_seqs + 1 = {num_seqs + 1} entries, got "
                         f"{query_start_loc.shape[0]}")
