"""The C++ CPU paged attention (kernels/csrc/paged_attention_cpu.cpp) against the torch
reference, over random block tables: mixed prefill/decode batches, GQA groups 1/3/4, head sizes
64/128, block sizes 8/16/32, float32 and bfloat16, odd sequence lengths."""

import itertools

import pytest
import torch

from kernels import cpu_attention, reference
from tests.kernels.conftest import TOLERANCES, PagedBatch, make_paged_batch

pytestmark = pytest.mark.usefixtures("cpu_extension")  # fails or skips without it

# (query_len, context_len): decodes at a block edge and past it, prefill chunks that start at
# position 0 or after a cached prefix, chunks longer than one 16-token tile, odd lengths.
MIXED = [(1, 1), (5, 15), (1, 15), (17, 17), (1, 16), (16, 333), (1, 17), (40, 40), (1, 333),
         (3, 3), (33, 97)]


def _check(batch: PagedBatch) -> None:
    out = cpu_attention.paged_attention(*batch.args())
    expected = reference.paged_attention(*batch.args_in_float32())
    assert out.dtype == batch.query.dtype and out.shape == batch.query.shape
    torch.testing.assert_close(out.float(), expected, **TOLERANCES[batch.query.dtype])


@pytest.mark.parametrize(
    ("group", "head_size", "block_size", "dtype"),
    list(itertools.product((1, 3, 4), (64, 128), (8, 16, 32), (torch.float32, torch.bfloat16))),
    ids=lambda v: str(v).replace("torch.", ""),
)
def test_mixed_batch_matches_reference(group, head_size, block_size, dtype) -> None:
    num_kv_heads = 2
    batch = make_paged_batch(
        [q for q, _ in MIXED], [c for _, c in MIXED], num_heads=group * num_kv_heads,
        num_kv_heads=num_kv_heads, head_size=head_size, block_size=block_size, dtype=dtype,
        seed=group * 1000 + head_size + block_size,
    )
    _check(batch)


@pytest.mark.parametrize("seed", range(4))
def test_random_batches(seed: int) -> None:
    """Random decode/prefill mixes and lengths, SmolLM2's head layout (9 heads on 3 KV heads)."""
    gen = torch.Generator().manual_seed(seed)
    num_seqs = int(torch.randint(1, 12, (), generator=gen))
    context_lens = torch.randint(1, 300, (num_seqs,), generator=gen).tolist()
    query_lens = [
        c if int(torch.randint(0, 3, (), generator=gen)) == 0
        else (1 if int(torch.randint(0, 2, (), generator=gen)) else
              int(torch.randint(1, c + 1, (), generator=gen)))
        for c in context_lens
    ]
    dtype = (torch.float32, torch.bfloat16)[seed % 2]
    _check(make_paged_batch(query_lens, context_lens, num_heads=9, num_kv_heads=3,
                            block_size=(8, 16, 32)[seed % 3], dtype=dtype, seed=seed))


@pytest.mark.parametrize(
    ("group", "block_size", "head_size", "dtype"),
    [(g, b, h, d) for (g, b), h, d in itertools.product(
        ((1, 8), (1, 16), (3, 16), (4, 64)), (64, 72), (torch.float32, torch.bfloat16))],
    ids=lambda v: str(v).replace("torch.", ""),
)
def test_a_token_gets_the_same_bits_in_a_prefill_as_in_a_decode(group, block_size, head_size,
                                                                dtype) -> None:
    """The last token of a 48-token context, computed as one row of a whole prefill (its last
    16-token tile has 16 * group >= block_size rows: the keys are transposed), of a 3-token
    chunk and alone as a decode (scores as dot products), over the same cache: bit for bit one
    result (a recompute after preemption or a prompt behind a cached prefix must not change
    later tokens). Head size 72: a tail past the 16-lane sums."""
    context = 48
    assert 16 * group >= block_size  # (the kernel's tile: the whole prefill transposes)
    batch = make_paged_batch([context], [context], num_heads=group * 2, num_kv_heads=2,
                             head_size=head_size, block_size=block_size, dtype=dtype,
                             seed=group + head_size + block_size)
    whole = cpu_attention.paged_attention(*batch.args())
    for query_len in (3, 1):
        part = PagedBatch(batch.query[-query_len:].clone(), batch.key_cache, batch.value_cache,
                          batch.block_tables, batch.seq_lens,
                          torch.tensor([0, query_len], dtype=torch.int32), batch.scale)
        out = cpu_attention.paged_attention(*part.args())
        assert torch.equal(out[-1], whole[-1]), f"query_len {query_len}"


def test_cache_views_of_the_engine_pool() -> None:
    """The engine passes kv_caches[layer, 0] / [layer, 1]: strided views of one pool."""
    batch = make_paged_batch([1, 7, 1], [30, 7, 64], num_heads=6, num_kv_heads=2)
    pool = torch.stack([torch.stack([batch.key_cache, batch.value_cache])] * 2)
    view = PagedBatch(batch.query, pool[1, 0], pool[1, 1], batch.block_tables, batch.seq_lens,
                      batch.query_start_loc, batch.scale)
    _check(view)


def test_dtype_mismatch_is_refused() -> None:
    batch = make_paged_batch([1], [5])
    with pytest.raises(RuntimeError, match="must share one dtype"):
        cpu_attention.paged_attention(batch.query.bfloat16(), *batch.args()[1:])


def test_block_ids_outside_the_pool_and_token_counts_that_disagree_are_refused() -> None:
    """Checked before any read: a bad block id would read outside the pool, query_start_loc
    past the query's tokens would read and write past them."""
    batch = make_paged_batch([1, 3], [20, 3])
    num_blocks = batch.key_cache.shape[0]
    for bad_id in (num_blocks, -5):
        tables = batch.block_tables.clone()
        tables[0, 1] = bad_id
        with pytest.raises(RuntimeError, match=f"sequence 0 block 1 is {bad_id}, outside the "
                                               f"pool's {num_blocks} blocks"):
            cpu_attention.paged_attention(batch.query, batch.key_cache, batch.value_cache,
                                          tables, *batch.args()[4:])
    too_far = batch.query_start_loc.clone()
    too_far[-1] = 40
    with pytest.raises(RuntimeError, match="must run from 0 to the 4 query tokens, got 0 to 40"):
        cpu_attention.paged_attention(*batch.args()[:5], too_far, batch.scale)
    _check(batch)  # the same batch, unchanged, is fine


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reshape_and_cache_matches_reference(dtype) -> None:
    """Slots in random blocks, a padding slot (-1) skipped, non-contiguous key rows (the
    engine's k is a view into the fused q/k tensor), caches as views of one pool."""
    gen = torch.Generator().manual_seed(5)
    num_blocks, block_size, kvh, d = 9, 16, 3, 64
    pool = torch.randn(2, 2, num_blocks, block_size, kvh, d, generator=gen).to(dtype)
    pools = [pool.clone(), pool.clone()]
    fused = torch.randn(7, 9 + kvh, d, generator=gen).to(dtype)
    key = fused[:, 9:]  # stride(0) = 12 * d: not contiguous
    value = torch.randn(7, kvh, d, generator=gen).to(dtype)
    slots = torch.tensor([3 * 16 + 5, 8 * 16 + 15, -1, 0, 4 * 16, 4 * 16 + 1, 7 * 16 + 9])
    reference.reshape_and_cache(key, value, pools[0][1, 0], pools[0][1, 1], slots)
    cpu_attention.reshape_and_cache(key, value, pools[1][1, 0], pools[1][1, 1], slots)
    assert torch.equal(pools[0], pools[1])
    assert torch.equal(pools[1][1, 0, 8, 15], key[1])  # and it did write
    with pytest.raises(RuntimeError, match="past the pool"):
        cpu_attention.reshape_and_cache(key[:1], value[:1], pools[1][1, 0], pools[1][1, 1],
                                        torch.tensor([num_blocks * block_size]))
