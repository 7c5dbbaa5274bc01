"""Triton paged attention against the torch reference (kernels/reference.py).

Mixed batches interleave decode tokens (context 1, 15, 16, 17, 333: empty-ish, one short of a
block, exactly a block, one past, many blocks) with prefill chunks that attend causally to a
cached prefix and to themselves, over random block tables.
"""

import pytest
import torch

from kernels import reference
from kernels.attention_splits import NO_SPLITS, KVSplitPolicy
from kernels.triton_attention import paged_attention
from tests.kernels.conftest import DEVICE, TOLERANCES, PagedBatch

# (query_len, context_len) per sequence, decode and prefill interleaved.
MIXED = [(1, 1), (5, 15), (1, 15), (17, 17), (1, 16), (16, 333), (1, 17), (40, 40), (1, 333)]
DECODE = [(1, 1), (1, 15), (1, 16), (1, 17), (1, 333)]
FORCED_SPLITS = KVSplitPolicy(target_programs=1, keys_per_split=32)


def _lens(seqs: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    return [q for q, _ in seqs], [c for _, c in seqs]


def _check(batch: PagedBatch, out: torch.Tensor) -> None:
    expected = reference.paged_attention(*batch.args_in_float32())
    assert out.dtype == batch.query.dtype and out.shape == batch.query.shape
    torch.testing.assert_close(out.float(), expected, **TOLERANCES[batch.query.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_mixed_prefill_decode_batch(paged_batch, dtype: torch.dtype) -> None:
    batch = paged_batch(*_lens(MIXED), dtype=dtype)
    _check(batch, paged_attention(*batch.args()))


@pytest.mark.parametrize(
    ("head_size", "block_size", "dtype"),
    [
        (80, 8, torch.float16),
        (96, 32, torch.float32),
        (128, 16, torch.bfloat16),
        (64, 8, torch.bfloat16),
        (80, 32, torch.float32),
    ],
    ids=lambda v: str(v).replace("torch.", ""),
)
def test_head_and_block_sizes(
    paged_batch, head_size: int, block_size: int, dtype: torch.dtype
) -> None:
    # 80 and 96 are not powers of two: the head dimension is a masked, padded tile.
    seqs = [(1, 17), (9, 40), (1, 333), (3, 3)]
    batch = paged_batch(*_lens(seqs), head_size=head_size, block_size=block_size, dtype=dtype)
    _check(batch, paged_attention(*batch.args()))


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads"),
    [(4, 4), (14, 2), (8, 1), (40, 2)],
    ids=lambda v: str(v),
)
def test_gqa_group_sizes(paged_batch, num_heads: int, num_kv_heads: int) -> None:
    # 7 and 20 query heads per KV head do not divide the row tile: some rows are padding.
    seqs = [(1, 16), (6, 21), (1, 40)]
    batch = paged_batch(*_lens(seqs), num_heads=num_heads, num_kv_heads=num_kv_heads,
                        head_size=64)
    _check(batch, paged_attention(*batch.args()))


def test_split_kv_mixed_batch(paged_batch) -> None:
    # Up to 4 splits of 32+ keys per query tile; context 1 .. 333: some tiles split, some not.
    batch = paged_batch(*_lens(MIXED), dtype=torch.float16)
    policy = KVSplitPolicy(target_programs=1, keys_per_split=32, max_splits=4)
    _check(batch, paged_attention(*batch.args(), kv_splits=policy))


def test_split_kv_decode_only(paged_batch) -> None:
    # Context 1 .. 333 at 32 keys a split: 1 to 11 splits a sequence.
    batch = paged_batch(*_lens(DECODE), block_size=8)
    _check(batch, paged_attention(*batch.args(), kv_splits=FORCED_SPLITS))


def test_decode_only_batch(paged_batch) -> None:
    batch = paged_batch(*_lens(DECODE), dtype=torch.bfloat16)
    _check(batch, paged_attention(*batch.args()))


def test_split_kv_equals_single_pass(paged_batch) -> None:
    # Same math, different order of summation: equal to float32 rounding.
    batch = paged_batch(*_lens(DECODE))
    torch.testing.assert_close(
        paged_attention(*batch.args(), kv_splits=FORCED_SPLITS),
        paged_attention(*batch.args(), kv_splits=NO_SPLITS),
        atol=1e-6, rtol=1e-6,
    )


def test_query_as_strided_view_of_fused_qkv(paged_batch) -> None:
    # The model splits a fused qkv projection: query rows are strided, not contiguous.
    batch = paged_batch(*_lens(MIXED))
    num_tokens, num_heads, head_size = batch.query.shape
    qkv = torch.randn(num_tokens, (num_heads + 4) * head_size, device=DEVICE)
    qkv[:, : num_heads * head_size] = batch.query.reshape(num_tokens, -1)
    query_view = qkv[:, : num_heads * head_size].view(num_tokens, num_heads, head_size)
    assert not query_view.is_contiguous()
    batch.query = query_view
    _check(batch, paged_attention(*batch.args()))


def test_plan_argument_is_accepted_and_ignored(paged_batch) -> None:
    batch = paged_batch(*_lens(MIXED))
    plan = reference.build_attention_plan(
        batch.block_tables, batch.seq_lens, batch.query_start_loc, batch.key_cache.shape[1]
    )
    torch.testing.assert_close(
        paged_attention(*batch.args(), plan=plan), paged_attention(*batch.args(), plan=None)
    )


def test_empty_batch(paged_batch) -> None:
    batch = paged_batch([1], [1])
    batch.query = batch.query[:0]
    batch.block_tables = batch.block_tables[:0]
    batch.seq_lens = batch.seq_lens[:0]
    batch.query_start_loc = batch.query_start_loc[:1]
    assert paged_attention(*batch.args()).shape == (0, 4, 64)


def test_rejects_heads_that_do_not_group(paged_batch) -> None:
    batch = paged_batch([1], [4], num_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match=r"query heads \(6\) must be a multiple of KV heads \(4\)"):
        paged_attention(*batch.args())


def test_rejects_split_count_that_is_not_a_power_of_two() -> None:
    with pytest.raises(ValueError, match="max_splits must be a power of two, got 3"):
        KVSplitPolicy(target_programs=8, max_splits=3)
