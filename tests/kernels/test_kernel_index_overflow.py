"""Block ids past 65,536 in a pool of more than 2**31 elements: offsets must be 64-bit.

The pool is the engine's layout, [num_layers, 2, num_blocks, block_size, num_kv_heads,
head_size], 8.6 GB of float16 here; torch.empty only reserves address space, and the kernels
touch a handful of blocks, so the test costs a few MB of real memory. With 32 x 4 x 128 =
16,384 elements per block, any block id >= 131,072 puts its offset past 2**31, where int32
offset math wraps (a wrong read, or a crash).
"""

import pytest
import torch

from kernels import reference
from kernels.triton_attention import paged_attention
from kernels.triton_cache_ops import copy_blocks, reshape_and_cache
from tests.kernels.conftest import DEVICE, TOLERANCES

BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, NUM_HEADS = 32, 4, 128, 8
NUM_BLOCKS = 131_136
assert 2 * NUM_BLOCKS * BLOCK_SIZE * NUM_KV_HEADS * HEAD_SIZE > 2**32
# (query_len, context_len, physical blocks): a prefill chunk and a decode token.
SEQS = [
    (3, 70, [131_100, 65_537, 131_135]),
    (1, 40, [131_077, 70_000]),
]


@pytest.fixture(scope="module")
def kv_caches() -> torch.Tensor:
    try:
        return torch.empty(
            1, 2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, dtype=torch.float16,
            device=DEVICE,
        )
    except (RuntimeError, MemoryError) as e:  # no address space / device memory for the pool
        pytest.skip(f"cannot reserve an 8.6 GB KV pool here: {e}")


def _slots(context_len: int, blocks: list[int]) -> list[int]:
    return [blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE for pos in range(context_len)]


def test_write_then_attend_past_int32_offsets(kv_caches: torch.Tensor) -> None:
    key_cache, value_cache = kv_caches[0, 0], kv_caches[0, 1]
    slots = torch.tensor([s for _, c, b in SEQS for s in _slots(c, b)], device=DEVICE)
    gen = torch.Generator().manual_seed(0)
    shape = (len(slots), NUM_KV_HEADS, HEAD_SIZE)
    key = torch.randn(shape, generator=gen).to(DEVICE, torch.float16)
    value = torch.randn(shape, generator=gen).to(DEVICE, torch.float16)

    reshape_and_cache(key, value, key_cache, value_cache, slots)
    flat_key = key_cache.view(-1, NUM_KV_HEADS, HEAD_SIZE)
    flat_value = value_cache.view(-1, NUM_KV_HEADS, HEAD_SIZE)
    assert torch.equal(flat_key[slots], key) and torch.equal(flat_value[slots], value)

    query_lens = [q for q, _, _ in SEQS]
    max_blocks = max(len(b) for _, _, b in SEQS)
    tables = torch.tensor([b + [b[0]] * (max_blocks - len(b)) for _, _, b in SEQS],
                          dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([c for _, c, _ in SEQS], dtype=torch.int32, device=DEVICE)
    query_start_loc = torch.tensor([0, query_lens[0], sum(query_lens)], dtype=torch.int32,
                                   device=DEVICE)
    query = torch.randn(sum(query_lens), NUM_HEADS, HEAD_SIZE, generator=gen)
    query = query.to(DEVICE, torch.float16)
    out = paged_attention(query, key_cache, value_cache, tables, seq_lens, query_start_loc,
                          HEAD_SIZE**-0.5)

    # Reference on a compact float32 copy of the used blocks (renumbered 0..n-1).
    used = tables.flatten().long().unique()
    compact_tables = torch.searchsorted(used, tables.long()).to(torch.int32)
    expected = reference.paged_attention(
        query.float(), key_cache[used].float(), value_cache[used].float(), compact_tables,
        seq_lens, query_start_loc, HEAD_SIZE**-0.5,
    )
    torch.testing.assert_close(out.float(), expected, **TOLERANCES[torch.float16])


def test_copy_blocks_past_int32_offsets(kv_caches: torch.Tensor) -> None:
    src, dst = 131_100, 131_130  # the V copy starts ~6.4e9 elements into the pool
    kv_caches[:, :, src] = torch.randn(kv_caches[:, :, src].shape).to(DEVICE, torch.float16)
    copy_blocks(kv_caches, torch.tensor([[src, dst]], device=DEVICE))
    assert torch.equal(kv_caches[:, :, dst], kv_caches[:, :, src])
