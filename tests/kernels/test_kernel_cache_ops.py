"""Triton reshape_and_cache and copy_blocks against the torch reference."""

import pytest
import torch

from kernels import reference
from kernels.triton_cache_ops import copy_blocks, reshape_and_cache
from tests.kernels.conftest import DEVICE

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _random_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                  dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    return torch.randn(shape, generator=gen).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_size", [64, 80])
def test_reshape_and_cache_writes_slots_and_skips_padding(
    dtype: torch.dtype, head_size: int
) -> None:
    num_blocks, block_size, num_kv_heads = 12, 16, 2
    key_cache = _random_cache(num_blocks, block_size, num_kv_heads, head_size, dtype, seed=0)
    value_cache = _random_cache(num_blocks, block_size, num_kv_heads, head_size, dtype, seed=1)
    expected_key, expected_value = key_cache.clone(), value_cache.clone()
    # Slots spread over blocks, first and last slot of a block, and two padding tokens (-1).
    slots = torch.tensor([5, -1, 16, 31, 191, 100, -1, 0, 47], device=DEVICE)
    key = torch.randn(len(slots), num_kv_heads, head_size, device=DEVICE).to(dtype)
    value = torch.randn(len(slots), num_kv_heads, head_size, device=DEVICE).to(dtype)

    reshape_and_cache(key, value, key_cache, value_cache, slots)
    reference.reshape_and_cache(key, value, expected_key, expected_value, slots)
    # Same dtype in and out: a pure copy, so bit-exact; padding leaves the cache untouched.
    assert torch.equal(key_cache, expected_key)
    assert torch.equal(value_cache, expected_value)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16], ids=str)
def test_reshape_and_cache_converts_float32_input(cache_dtype: torch.dtype) -> None:
    key_cache = torch.zeros(4, 8, 1, 64, dtype=cache_dtype, device=DEVICE)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.tensor([3, 9, 30], device=DEVICE)
    key = torch.randn(3, 1, 64, device=DEVICE)
    value = torch.randn(3, 1, 64, device=DEVICE)
    reshape_and_cache(key, value, key_cache, value_cache, slots)
    flat = key_cache.view(-1, 1, 64)
    # Within one ulp of the cache dtype: the GPU rounds to nearest, the interpreter truncates.
    ulp = {torch.float16: 2**-10, torch.bfloat16: 2**-7}[cache_dtype]
    torch.testing.assert_close(flat[slots].float(), key, atol=1e-6, rtol=ulp)
    torch.testing.assert_close(value_cache.view(-1, 1, 64)[slots].float(), value, atol=1e-6,
                               rtol=ulp)


def test_reshape_and_cache_from_strided_views() -> None:
    # K and V arrive as column slices of a fused qkv projection.
    num_tokens, num_kv_heads, head_size = 6, 2, 64
    qkv = torch.randn(num_tokens, (4 + 2 * num_kv_heads) * head_size, device=DEVICE)
    kv_width = num_kv_heads * head_size
    key = qkv[:, 4 * head_size: 4 * head_size + kv_width].view(num_tokens, num_kv_heads, head_size)
    value = qkv[:, 4 * head_size + kv_width:].view(num_tokens, num_kv_heads, head_size)
    key_cache = torch.zeros(3, 16, num_kv_heads, head_size, device=DEVICE)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.tensor([40, 41, 42, 43, 2, -1], device=DEVICE)
    reshape_and_cache(key, value, key_cache, value_cache, slots)
    expected_key, expected_value = torch.zeros_like(key_cache), torch.zeros_like(value_cache)
    reference.reshape_and_cache(key, value, expected_key, expected_value, slots)
    assert torch.equal(key_cache, expected_key) and torch.equal(value_cache, expected_value)


def test_reshape_and_cache_rejects_mismatched_cache() -> None:
    key = torch.randn(2, 2, 64, device=DEVICE)
    cache = torch.zeros(4, 16, 4, 64, device=DEVICE)
    with pytest.raises(ValueError, match="does not fit key cache"):
        reshape_and_cache(key, key, cache, cache, torch.tensor([0, 1], device=DEVICE))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_copy_blocks_every_layer_k_and_v(dtype: torch.dtype) -> None:
    num_layers, num_blocks = 3, 10
    gen = torch.Generator().manual_seed(0)
    kv_caches = torch.randn(num_layers, 2, num_blocks, 8, 2, 80, generator=gen).to(DEVICE, dtype)
    expected = kv_caches.clone()
    mapping = torch.tensor([[1, 4], [2, 7], [9, 0]], device=DEVICE)
    copy_blocks(kv_caches, mapping)
    reference.copy_blocks(expected, mapping)
    assert torch.equal(kv_caches, expected)
    # The copies really happened (the reference could be a no-op too).
    assert torch.equal(kv_caches[:, :, 4], kv_caches[:, :, 1])
    assert not torch.equal(kv_caches[:, :, 4], kv_caches[:, :, 5])


def test_copy_blocks_int32_mapping_and_large_blocks() -> None:
    # 32 x 4 x 128 = 16,384 elements per block: several programs per block.
    kv_caches = torch.randn(2, 2, 5, 32, 4, 128, device=DEVICE)
    expected = kv_caches.clone()
    mapping = torch.tensor([[0, 3]], dtype=torch.int32, device=DEVICE)
    copy_blocks(kv_caches, mapping)
    reference.copy_blocks(expected, mapping.long())
    assert torch.equal(kv_caches, expected)


def test_copy_blocks_empty_mapping_is_a_no_op() -> None:
    kv_caches = torch.randn(1, 2, 4, 8, 1, 64, device=DEVICE)
    before = kv_caches.clone()
    copy_blocks(kv_caches, torch.empty(0, 2, dtype=torch.int64, device=DEVICE))
    assert torch.equal(kv_caches, before)
