"""Paged attention in Triton: one kernel for mixed prefill + decode batches.

Each program owns a tile of query rows for one KV head: BLOCK_Q consecutive query tokens of one
sequence times the QUERIES_PER_KV query heads that share that KV head (GQA), so K/V are read
once per group instead of once per query head. It walks its keys in tiles of TILE_N positions
through the block table with an online softmax (running max, running sum).

Two modes, fixed per launch by the host from shapes alone (DECODE: one token per sequence):
- Prefill / mixed batches: query tile b belongs to the last sequence i with
  query_start_loc[i] // BLOCK_Q + i <= b (binary search in the kernel), which over-counts by at
  most one tile per sequence; surplus tiles exit at once. Tile shapes are per model
  (kernels/attention_tiles.py: timed at a CUDA warm-up).
- Decode batches split each sequence's keys (flash-decoding) by its own length: the grid's
  first axis is a list of work items, (sequence, split) pairs numbered sequence by sequence,
  which every program derives on the device from the context lengths (kernels/
  attention_splits.py has the policy and the same arithmetic on the host). A sequence of one
  split writes its output; the others write an unnormalised partial (acc, max, sum) per item
  and `_combine_splits_kernel` merges each sequence's partials. No host metadata, no sync:
  a CUDA graph captured for n sequences serves every step of n.
"""

import torch
import triton
import triton.language as tl

from kernels.attention_splits import KVSplitPolicy, decode_tile_n, default_split_policy
from kernels.attention_tiles import (
    MIN_DOT_ROWS,
    PrefillTiles,
    default_prefill_tiles,
    fp32_num_warps,
)
from kernels.launch_counter import count_launch
from kernels.triton_jit import INTERPRETED, MAX_COMBINE, SUM_COMBINE, jit

LOG2_E = 1.4426950408889634
# Constants the kernels read (Triton reads only constexpr globals).
SEQ_CHUNK = tl.constexpr(256)  # context lengths a decode program reads per planning loop step
SPLIT_CHUNK = tl.constexpr(16)  # partials the combine kernel merges per loop step


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


@jit
def _split_count(num_tiles, tiles_per_split, MAX_SPLITS: tl.constexpr):
    """Splits of a sequence of num_tiles key tiles (attention_splits.split_count)."""
    num_tiles = tl.maximum(num_tiles, 1)
    return tl.minimum((num_tiles + tiles_per_split - 1) // tiles_per_split, MAX_SPLITS)


@jit
def _plan_tiles_per_split(
    seq_lens_ptr,  # [num_seqs] int32
    num_seqs,
    num_kv_heads,
    target_programs,
    forced_tiles_per_split,
    min_tiles_per_split,
    TILE_N: tl.constexpr,
):
    """P in key tiles: the batch's key tiles x KV heads spread over target_programs, at
    least min_tiles_per_split (or the forced value when > 0)."""
    total = num_seqs * 0
    for start in range(0, num_seqs, SEQ_CHUNK):
        index = start + tl.arange(0, SEQ_CHUNK)
        lens = tl.load(seq_lens_ptr + index, mask=index < num_seqs, other=0)
        total += tl.reduce((lens + TILE_N - 1) // TILE_N, 0, SUM_COMBINE)
    planned = (total * num_kv_heads + target_programs - 1) // target_programs
    planned = tl.maximum(planned, min_tiles_per_split)
    return tl.where(forced_tiles_per_split > 0, forced_tiles_per_split, planned)


@jit
def _locate_work_item(
    seq_lens_ptr,  # [num_seqs] int32
    num_seqs,
    work,
    tiles_per_split,
    TILE_N: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
):
    """(sequence, its first work item) of work item `work`: items are numbered sequence by
    sequence, s_i of them for sequence i. A sequence index of num_seqs: past the last item."""
    seq = work * 0
    first = work * 0
    done = work * 0  # items of the chunks before this one
    for start in range(0, num_seqs, SEQ_CHUNK):
        index = start + tl.arange(0, SEQ_CHUNK)
        valid = index < num_seqs
        lens = tl.load(seq_lens_ptr + index, mask=valid, other=0)
        splits = _split_count((lens + TILE_N - 1) // TILE_N, tiles_per_split, MAX_SPLITS)
        splits = tl.where(valid, splits, 0)
        # One past each sequence's items (a combine function of the interpreter's own: a jit
        # one runs element by element there, 10x slower).
        ends = done + tl.associative_scan(splits, 0, SUM_COMBINE)
        before = valid & (ends <= work)  # sequences wholly before this item
        seq += tl.reduce(before.to(tl.int32), 0, SUM_COMBINE)
        first = tl.maximum(first, tl.reduce(tl.where(before, ends, 0), 0, MAX_COMBINE))
        done += tl.reduce(splits, 0, SUM_COMBINE)
    return seq, first


# Per-step integers: a variant compiled for one value must serve every step (see triton_jit).
ATTENTION_PER_STEP_ARGS = ("num_seqs", "stride_table_seq", "target_programs",
                           "forced_tiles_per_split", "min_tiles_per_split")


@jit(do_not_specialize=ATTENTION_PER_STEP_ARGS)
def paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_size]
    partial_acc_ptr,  # [items, num_heads, HEAD_PAD] fp32  (items: decode work items, or
    partial_max_ptr,  # [items, num_heads] fp32, log2       tokens x key splits of prefill)
    partial_sum_ptr,  # [items, num_heads] fp32
    split_meta_ptr,  # [num_tokens, 2] int32: each token's first item and split count
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
    target_programs,  # DECODE: the split policy (kernels/attention_splits.py)
    forced_tiles_per_split,  # > 0: P fixed, in tiles
    min_tiles_per_split,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # next power of two >= HEAD_SIZE (80, 96 -> 128), masked
    BLOCK_SIZE: tl.constexpr,  # tokens per KV cache block
    TILE_N: tl.constexpr,  # key positions per loop step (any power of two; may span blocks)
    BLOCK_M: tl.constexpr,  # query rows per program = BLOCK_Q tokens x QUERIES_PER_KV heads
    BLOCK_Q: tl.constexpr,
    DECODE: tl.constexpr,  # one query token per sequence: split keys per sequence
    MAX_SPLITS: tl.constexpr,  # DECODE: splits per sequence at most (1: never split)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 (no silent tf32), else the default
    DOT_IN_FP32: tl.constexpr,  # upcast dot operands (the interpreter cannot multiply bf16)
):
    kv_head = tl.program_id(1)
    if DECODE:
        work = tl.program_id(0)
        if MAX_SPLITS == 1:
            seq = work
            first_work = work
            tiles_per_split = 1  # one split holds every tile
        else:
            tiles_per_split = _plan_tiles_per_split(
                seq_lens_ptr, num_seqs, tl.num_programs(1), target_programs,
                forced_tiles_per_split, min_tiles_per_split, TILE_N)
            seq, first_work = _locate_work_item(seq_lens_ptr, num_seqs, work, tiles_per_split,
                                                TILE_N, MAX_SPLITS)
            if seq >= num_seqs:
                return
        q_tile_in_seq = 0
        split = work - first_work
    else:
        tile_index = tl.program_id(0)
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

    # Keys this tile needs: 0 .. last valid query position (causal).
    last_q_in_seq = tl.minimum((q_tile_in_seq + 1) * BLOCK_Q, q_len) - 1
    num_keys = num_cached + last_q_in_seq + 1
    num_kv_tiles = (num_keys + TILE_N - 1) // TILE_N
    if DECODE:
        # Split j of s holds tiles [j * n // s, (j + 1) * n // s): sizes differ by at most one
        # tile, none is empty (s <= n).
        num_splits = _split_count(num_kv_tiles, tiles_per_split, MAX_SPLITS)
        first_kv_tile = split * num_kv_tiles // num_splits
        end_kv_tile = (split + 1) * num_kv_tiles // num_splits
        if MAX_SPLITS > 1:
            if split == 0:
                tl.store(split_meta_ptr + 2 * seq, first_work)
                tl.store(split_meta_ptr + 2 * seq + 1, num_splits)
    else:
        # Few query tiles over long contexts (the host gave the grid a split axis): the tile's
        # keys cut evenly into as many splits as that axis has, each of at least
        # min_tiles_per_split tiles (or forced_tiles_per_split, when > 0).
        min_tiles = tl.where(forced_tiles_per_split > 0, forced_tiles_per_split,
                             min_tiles_per_split)
        num_splits = tl.maximum(tl.minimum(tl.num_programs(2), num_kv_tiles // min_tiles), 1)
        if split >= num_splits:
            return
        first_kv_tile = split * num_kv_tiles // num_splits
        end_kv_tile = (split + 1) * num_kv_tiles // num_splits
        if tl.num_programs(2) > 1:
            if split == 0:  # each token's partials: items token * S .. token * S + count - 1
                first_item = (token * tl.num_programs(2)).to(tl.int32)
                tl.store(split_meta_ptr + 2 * token, first_item, mask=row_valid)
                tl.store(split_meta_ptr + 2 * token + 1, num_splits + first_item * 0,
                         mask=row_valid)

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
    o_offsets = token[:, None] * stride_o_token + head[:, None] * stride_o_head + dims[None, :]
    if DECODE and MAX_SPLITS == 1:
        _store_output(out_ptr + o_offsets, acc, running_sum, out_mask)
    elif num_splits == 1:
        _store_output(out_ptr + o_offsets, acc, running_sum, out_mask)
    else:
        # One partial per (item, head), items numbered as the combine kernel reads them:
        # decode, the work item; prefill, token * splits + split.
        if DECODE:
            item = work + rows * 0
        else:
            item = token * tl.num_programs(2) + split
        row_id = (item * (QUERIES_PER_KV * tl.num_programs(1)) + head).to(tl.int64)
        tl.store(partial_max_ptr + row_id, running_max, mask=row_valid)
        tl.store(partial_sum_ptr + row_id, running_sum, mask=row_valid)
        tl.store(partial_acc_ptr + row_id[:, None] * HEAD_PAD + dims[None, :], acc, mask=out_mask)


@jit
def _store_output(out_ptrs, acc, running_sum, mask):
    """The normalised output of a program that saw all of its rows' keys."""
    # Padded rows may have sum 0; divide by 1 there (their store is masked anyway).
    out = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
    tl.store(out_ptrs, out.to(out_ptrs.dtype.element_ty), mask=mask)


@jit(do_not_specialize=("num_seqs",))
def _combine_splits_kernel(
    out_ptr,  # [num_tokens, num_heads, head_size]
    partial_acc_ptr,  # [items, num_heads, HEAD_PAD] fp32
    partial_max_ptr,  # [items, num_heads] fp32, log2 domain
    partial_sum_ptr,  # [items, num_heads] fp32
    split_meta_ptr,  # [num_tokens, 2] int32: the token's first item, its split count
    query_start_loc_ptr,  # [num_seqs + 1] int32
    num_seqs,
    stride_o_token,
    stride_o_head,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    # A mixed-step graph's padding tokens belong to no sequence: no program wrote their
    # split metadata (nor their output), so there is nothing to read.
    if token >= tl.load(query_start_loc_ptr + num_seqs):
        return
    first = tl.load(split_meta_ptr + 2 * token)
    num_splits = tl.load(split_meta_ptr + 2 * token + 1)
    if num_splits == 1:
        return  # the attention program wrote this sequence's output itself
    splits = tl.arange(0, MAX_SPLITS)
    split_rows = (first + splits).to(tl.int64) * num_heads + head
    split_max = tl.load(partial_max_ptr + split_rows, mask=splits < num_splits,
                        other=float("-inf"))
    # Split 0 holds key 0, which every query sees, so the global max is finite.
    global_max = tl.reduce(split_max, 0, MAX_COMBINE)
    split_sum = tl.load(partial_sum_ptr + split_rows, mask=splits < num_splits, other=0.0)
    total = tl.reduce(split_sum * tl.exp2(split_max - global_max), 0, SUM_COMBINE)
    dims = tl.arange(0, HEAD_PAD)
    acc = tl.full([HEAD_PAD], 0.0, tl.float32)
    for start in range(0, num_splits, SPLIT_CHUNK):  # [SPLIT_CHUNK, HEAD_PAD] at a time
        chunk = start + tl.arange(0, SPLIT_CHUNK)
        valid = chunk < num_splits
        rows = (first + chunk).to(tl.int64) * num_heads + head
        weight = tl.exp2(tl.load(partial_max_ptr + rows, mask=valid, other=float("-inf"))
                         - global_max)
        part = tl.load(partial_acc_ptr + rows[:, None] * HEAD_PAD + dims[None, :],
                       mask=valid[:, None], other=0.0)
        acc += tl.reduce(part * weight[:, None], 0, SUM_COMBINE)
    tl.store(
        out_ptr + token * stride_o_token + head * stride_o_head + dims,
        (acc / total).to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_SIZE,
    )


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    plan: object | None = None,
    kv_splits: KVSplitPolicy | None = None,
    prefill_tiles: PrefillTiles | None = None,
) -> torch.Tensor:
    """Causal attention of every query token over its sequence's paged context (Triton).

    Same contract as `kernels.reference.paged_attention`. `plan` is accepted for interface
    compatibility and ignored (the kernel needs no precomputed indices). `kv_splits`: how a
    decode batch splits its keys (None: the device's default policy); `prefill_tiles`: the
    tile shape of prefill / mixed batches (None: the default for the dtype).
    """
    num_tokens, num_heads, head_size = query.shape
    num_blocks, block_size, num_kv_heads, cache_head_size = key_cache.shape
    num_seqs = block_tables.shape[0]
    _check_inputs(query, key_cache, value_cache, num_heads, num_kv_heads, head_size,
                  cache_head_size, query_start_loc, num_seqs)
    out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    queries_per_kv = num_heads // num_kv_heads
    head_pad = max(16, triton.next_power_of_2(head_size))
    group_rows = max(MIN_DOT_ROWS, triton.next_power_of_2(queries_per_kv))
    decode = num_tokens == num_seqs
    policy = kv_splits or default_split_policy(query.device)
    if decode:
        # Decode rows hold one token each, so a taller tile would only add masked rows.
        block_m, tile_n = group_rows, decode_tile_n(block_size)
        num_warps = 4 if query.dtype != torch.float32 else fp32_num_warps(head_pad)
        num_stages = None
        grid_rows = num_seqs
        if policy.max_splits > 1:
            grid_rows = policy.work_items(num_seqs, num_kv_heads,
                                          block_tables.shape[1] * block_size)
        grid = (grid_rows, num_kv_heads, 1)
        items = grid_rows if policy.max_splits > 1 else 0
    else:
        tiles = prefill_tiles or default_prefill_tiles(query.dtype, head_pad, block_size)
        block_m, tile_n = max(tiles.block_m, group_rows), tiles.tile_n
        num_warps, num_stages = tiles.num_warps, tiles.num_stages
        num_q_tiles = num_tokens // (block_m // queries_per_kv) + num_seqs  # module docstring
        prefill_splits = policy.prefill_splits(num_q_tiles, num_kv_heads)
        grid = (num_q_tiles, num_kv_heads, prefill_splits)
        items = num_tokens * prefill_splits if prefill_splits > 1 else 0
    block_q = block_m // queries_per_kv
    f32 = dict(dtype=torch.float32, device=query.device)
    if items:
        partial_acc = torch.empty((items, num_heads, head_pad), **f32)
        partial_max = torch.empty((items, num_heads), **f32)
        partial_sum = torch.empty_like(partial_max)
        split_meta = torch.empty((num_tokens, 2), dtype=torch.int32, device=query.device)
    elif decode:
        partial_acc = partial_max = partial_sum = out  # unused (MAX_SPLITS == 1)
        split_meta = seq_lens
    else:
        # Never written with one split, but of the split case's types, so that both run one
        # compiled variant.
        partial_acc = partial_max = partial_sum = torch.empty(1, **f32)
        split_meta = torch.empty(2, dtype=torch.int32, device=query.device)
    min_tiles = -(-policy.min_keys_per_split // tile_n)
    forced_tiles = -(-policy.keys_per_split // tile_n)
    options = {} if num_stages is None else {"num_stages": num_stages}
    count_launch("paged_attention")
    paged_attention_kernel[grid](
        out, partial_acc, partial_max, partial_sum, split_meta,
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        scale * LOG2_E, num_seqs,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        policy.target_programs, forced_tiles, min_tiles,
        QUERIES_PER_KV=queries_per_kv,
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        DECODE=decode,
        MAX_SPLITS=policy.max_splits if decode else 1,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        DOT_IN_FP32=INTERPRETED and torch.bfloat16 in (query.dtype, key_cache.dtype),
        num_warps=num_warps,
        **options,
    )
    if items:
        count_launch("combine_splits")
        _combine_splits_kernel[(num_tokens, num_heads)](
            out, partial_acc, partial_max, partial_sum, split_meta, query_start_loc, num_seqs,
            out.stride(0), out.stride(1),
            HEAD_SIZE=head_size, HEAD_PAD=head_pad, MAX_SPLITS=policy.max_splits,
        )
    return out


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
