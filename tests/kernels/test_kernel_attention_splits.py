"""Decode attention split per sequence (kernels/attention_splits.py, the kernel's decode mode)
against the torch reference, and the split policy's arithmetic.

The batches are skewed as serving makes them: one long context among many short ones, so one
sequence gets many splits while the others get one; the split sizes are forced small (the
interpreter runs tiny shapes) and also chosen by the policy from the batch, with a small
program target standing in for a GPU's SMs.
"""

import random

import pytest
import torch

from kernels import reference
from kernels.attention_splits import (
    MIN_KEYS_PER_SPLIT,
    NO_SPLITS,
    PROGRAMS_PER_SM,
    KVSplitPolicy,
    decode_tile_n,
    plan_splits,
    split_count,
)
from kernels.triton_attention import paged_attention
from tests.kernels.conftest import TOLERANCES, PagedBatch, make_paged_batch


def _skewed_lens(seed: int, num_short: int, long_len: int) -> list[int]:
    rng = random.Random(seed)
    lens = [rng.randint(1, 40) for _ in range(num_short)]
    lens.insert(rng.randrange(num_short + 1), long_len)
    return lens


def _decode_batch(lens: list[int], **shape) -> PagedBatch:
    return make_paged_batch([1] * len(lens), lens, **shape)


def _check(batch: PagedBatch, out: torch.Tensor) -> None:
    expected = reference.paged_attention(*batch.args_in_float32())
    assert out.dtype == batch.query.dtype and out.shape == batch.query.shape
    torch.testing.assert_close(out.float(), expected, **TOLERANCES[batch.query.dtype])


@pytest.mark.parametrize(
    ("seed", "num_heads", "num_kv_heads", "block_size", "keys_per_split"),
    [
        (0, 4, 1, 16, 32),  # GQA with one KV head; 14 splits for the long sequence
        (1, 6, 2, 32, 64),  # 3 query heads a KV head (padded rows); blocks of 32
        (2, 4, 2, 16, 96),  # splits of 3 tiles: the last split of a sequence is shorter
    ],
)
def test_skewed_batch_with_forced_split_size(seed, num_heads, num_kv_heads, block_size,
                                             keys_per_split) -> None:
    lens = _skewed_lens(seed, num_short=6, long_len=420)
    batch = _decode_batch(lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=32,
                          block_size=block_size, seed=seed)
    policy = KVSplitPolicy(target_programs=1, keys_per_split=keys_per_split)
    splits = plan_splits(policy, lens, num_kv_heads, decode_tile_n(block_size))
    assert max(splits) > 4 and min(splits) == 1, splits  # some sequences many, some one
    _check(batch, paged_attention(*batch.args(), kv_splits=policy))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_skewed_batch_with_policy_chosen_split_size(dtype: torch.dtype) -> None:
    # The policy picks P from the batch (the kernel computes it on the device); the grid is
    # sized by the host's bound alone, so a lost work item would leave an output unwritten.
    lens = _skewed_lens(3, num_short=7, long_len=900)
    policy = KVSplitPolicy(target_programs=24, min_keys_per_split=32)
    splits = plan_splits(policy, lens, 2, decode_tile_n(16))
    assert max(splits) >= 8 and sum(splits) <= policy.work_items(len(lens), 2, max(lens)), splits
    batch = _decode_batch(lens, num_heads=4, num_kv_heads=2, head_size=32, dtype=dtype, seed=3)
    _check(batch, paged_attention(*batch.args(), kv_splits=policy))


def test_split_cap_spreads_a_long_sequence_over_max_splits() -> None:
    # 40 tiles at one tile a split, capped at 4 splits: 10 tiles each.
    lens = [1250, 3]
    policy = KVSplitPolicy(target_programs=1, keys_per_split=32, max_splits=4)
    assert plan_splits(policy, lens, 1, 32) == [4, 1]
    batch = _decode_batch(lens, num_heads=2, num_kv_heads=1, head_size=32, seed=5)
    _check(batch, paged_attention(*batch.args(), kv_splits=policy))


def test_padding_rows_of_a_decode_graph_split_too() -> None:
    # A decode graph's padding rows have context 1 (one key of block 0) and share the grid.
    lens = [600, 1, 1, 1]
    batch = _decode_batch(lens, num_heads=4, num_kv_heads=2, head_size=32, seed=6)
    batch.block_tables[1:, 0] = 0
    policy = KVSplitPolicy(target_programs=16, min_keys_per_split=32)
    out = paged_attention(*batch.args(), kv_splits=policy)
    _check(batch, out)
    torch.testing.assert_close(out, paged_attention(*batch.args(), kv_splits=NO_SPLITS),
                               atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_short_chunk_at_a_long_position_splits_its_keys(dtype: torch.dtype) -> None:
    # A 20-token chunk ending a 600-token context beside decodes: few query tiles, so the
    # policy gives the grid a split axis and each tile cuts its keys (rows near the chunk's
    # start see fewer keys than its last row: some of their splits are empty).
    query_lens, context_lens = [1, 20, 1, 3], [9, 600, 40, 3]
    policy = KVSplitPolicy(target_programs=64, min_keys_per_split=64, max_splits=8)
    num_q_tiles = sum(query_lens) // 8 + len(query_lens)  # more than the kernel has
    assert policy.prefill_splits(num_q_tiles, 2) > 1
    batch = make_paged_batch(query_lens, context_lens, num_heads=4, num_kv_heads=2,
                             head_size=32, dtype=dtype, seed=8)
    out = paged_attention(*batch.args(), kv_splits=policy)
    _check(batch, out)
    if dtype == torch.float32:
        torch.testing.assert_close(out, paged_attention(*batch.args(), kv_splits=NO_SPLITS),
                                   atol=1e-6, rtol=1e-6)


def test_split_chunk_with_padding_tokens_of_a_mixed_graph() -> None:
    # A mixed-step graph's bucket has tokens past the last sequence's (no sequence, output
    # left unwritten): the combine step must not read their (unwritten) split metadata.
    query_lens, context_lens = [1, 20], [9, 600]
    batch = make_paged_batch(query_lens, context_lens, num_heads=4, num_kv_heads=2,
                             head_size=32, seed=9)
    real = batch.query.shape[0]
    padded = torch.randn(real + 5, 4, 32, generator=torch.Generator().manual_seed(1))
    padded[:real] = batch.query
    policy = KVSplitPolicy(target_programs=64, min_keys_per_split=64, max_splits=8)
    out = paged_attention(padded.to(batch.query.device), *batch.args()[1:], kv_splits=policy)
    _check(batch, out[:real])


# ---- the policy's arithmetic (host mirror of the kernel's) ----------------------------------

H200_SMS, H200_KV_HEADS, TILE = 132, 8, 32
H200 = KVSplitPolicy(target_programs=PROGRAMS_PER_SM * H200_SMS)
ISSUE_SHAPES = {  # issue 30's decode shapes
    "1x8192": [8192],
    "8x2048": [2048] * 8,
    "64x1024": [1024] * 64,
    "256x512": [512] * 256,
    "skewed": [32768] + [512] * 63,
}


@pytest.mark.parametrize("name", list(ISSUE_SHAPES))
def test_issue_shapes_fill_the_sms_without_tiny_splits(name: str) -> None:
    lens = ISSUE_SHAPES[name]
    splits = plan_splits(H200, lens, H200_KV_HEADS, TILE)
    programs = sum(splits) * H200_KV_HEADS
    # At least two programs per SM (or every sequence already past the target), and never
    # more than the grid the host sized.
    assert programs >= min(2 * H200_SMS, len(lens) * H200_KV_HEADS * 2) or (
        len(lens) * H200_KV_HEADS >= H200.target_programs), (name, programs)
    assert sum(splits) <= H200.work_items(len(lens), H200_KV_HEADS, max(lens))
    for n, s in zip(lens, splits, strict=True):
        if s > 1:  # every split of a split sequence sees at least the minimum
            assert n // s >= MIN_KEYS_PER_SPLIT - TILE, (name, n, s)


def test_skewed_batch_splits_the_long_sequence_only() -> None:
    splits = plan_splits(H200, ISSUE_SHAPES["skewed"], H200_KV_HEADS, TILE)
    assert splits[0] >= 32 and set(splits[1:]) == {1}, splits
    assert plan_splits(H200, ISSUE_SHAPES["256x512"], H200_KV_HEADS, TILE) == [1] * 256


def test_split_count_never_falls_as_a_sequence_grows() -> None:
    for per in (1, 3, 8):
        for cap in (1, 4, 64):
            counts = [split_count(tiles, per, cap) for tiles in range(1, 400)]
            assert counts == sorted(counts)
            assert max(counts) <= cap
            # Never more splits than tiles (none empty), and none above P tiles unless capped.
            for tiles, splits in enumerate(counts, start=1):
                assert 1 <= splits <= tiles
                assert splits == cap or -(-tiles // splits) <= per


def test_prefill_splits_only_small_grids() -> None:
    # 256 new tokens at a long position (Llama-8B: 64-row tiles of 16 tokens): 17 tiles x 8
    # KV heads -> 2 splits; a 2,048-token chunk, or 64 decodes beside a chunk, none.
    assert H200.prefill_splits(256 // 16 + 1, 8) == 2
    assert H200.prefill_splits(2048 // 16 + 1, 8) == 1
    assert H200.prefill_splits(64 + 256 // 16 + 65, 8) == 1
    assert H200.prefill_splits(2, 8) == 32  # a 16-token chunk: up to 32 (min keys decide)
    assert NO_SPLITS.prefill_splits(1, 1) == 1


def test_more_keys_in_the_batch_never_mean_smaller_splits() -> None:
    rng = random.Random(7)
    for _ in range(200):
        lens = [rng.randint(1, 5000) for _ in range(rng.randint(1, 40))]
        tiles = sum(-(-n // TILE) for n in lens)
        more = tiles + rng.randint(0, 500)
        assert H200.tiles_per_split(more, 8, TILE) >= H200.tiles_per_split(tiles, 8, TILE)
        assert sum(plan_splits(H200, lens, 8, TILE)) <= H200.work_items(len(lens), 8, max(lens))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [("target_programs", 0, "target_programs must be an int >= 1, got 0"),
     ("max_splits", 6, "max_splits must be a power of two, got 6"),
     ("min_keys_per_split", -1, "min_keys_per_split must be an int >= 1, got -1"),
     ("keys_per_split", -5, "keys_per_split must be an int >= 0")],
)
def test_policy_refuses_bad_fields(field: str, value: int, message: str) -> None:
    kwargs = {"target_programs": 8, field: value}
    with pytest.raises(ValueError, match=message):
        KVSplitPolicy(**kwargs)
