"""Chained block hashes shared by the engine and the prefix index (see DESIGN.md).

h_i = xxh3_128(h_{i-1} || tokens_i as little-endian int32 || extra_i), with h_0 a seed derived
from the model identity and block size, and extra_0 the request's cache_salt. Only full blocks
are hashed. Everything here is deterministic across processes and machines (no Python hash()).
"""

from __future__ import annotations

import struct

import xxhash

HASH_BYTES = 16
_HASH_VERSION = b"pagedgen-block-hash-v1"


def model_seed_hash(model_identity: str, block_size: int) -> bytes:
    """h_0: ties every chain to one model (path/name + revision + dtype) and one block size."""
    payload = _HASH_VERSION + b"|" + model_identity.encode() + b"|" + str(block_size).encode()
    return xxhash.xxh3_128_digest(payload)


def hash_block(
    parent_hash: bytes, token_ids: list[int] | tuple[int, ...], extra: bytes = b""
) -> bytes:
    """The 16-byte hash of one full block given its parent's hash."""
    tokens = struct.pack(f"<{len(token_ids)}i", *token_ids)
    return xxhash.xxh3_128_digest(parent_hash + tokens + extra)


def salt_bytes(cache_salt: str | None) -> bytes:
    """extra_0: different salts never share blocks (length-prefixed: no salt prefixes another)."""
    if not cache_salt:
        return b""
    encoded = cache_salt.encode()
    return struct.pack("<I", len(encoded)) + encoded


def extend_block_hashes(
    hashes: list[bytes],
    token_ids: list[int],
    block_size: int,
    seed_hash: bytes,
    cache_salt: str | None,
) -> None:
    """Append the hashes of the full blocks of token_ids that `hashes` does not cover yet."""
    num_full_blocks = len(token_ids) // block_size
    for block_index in range(len(hashes), num_full_blocks):
        parent = hashes[-1] if hashes else seed_hash
        extra = salt_bytes(cache_salt) if block_index == 0 else b""
        start = block_index * block_size
        hashes.append(hash_block(parent, token_ids[start : start + block_size], extra))


def hash_identity(model_identity: str, dtype: str) -> str:
    """What a chain is tied to besides the block size: the model and the dtype of its KV (the
    same tokens in another dtype are other bytes)."""
    return f"{model_identity}:{dtype}"


class BlockHasher:
    """The one place an engine's block-hash chain is computed: the KV cache, PinPrefix, the
    prefix-index link and the router all use this, so they agree on every hash."""

    __slots__ = ("identity", "block_size", "seed_hash")

    def __init__(self, model_identity: str, dtype: str, block_size: int) -> None:
        self.identity = hash_identity(model_identity, dtype)
        self.block_size = block_size
        self.seed_hash = model_seed_hash(self.identity, block_size)

    @classmethod
    def for_identity(cls, identity: str, block_size: int) -> BlockHasher:
        """The hasher of an engine that reports `identity` (ModelInfo.model_identity, the dtype
        already in it) and `block_size`: what the router hashes prompts with."""
        hasher = cls.__new__(cls)
        hasher.identity = identity
        hasher.block_size = block_size
        hasher.seed_hash = model_seed_hash(identity, block_size)
        return hasher

    def extend(self, hashes: list[bytes], token_ids: list[int], cache_salt: str | None) -> None:
        """Append the hashes of token_ids' full blocks that `hashes` does not cover yet."""
        extend_block_hashes(hashes, token_ids, self.block_size, self.seed_hash, cache_salt)

    def chain(self, token_ids: list[int], cache_salt: str | None) -> list[bytes]:
        """The hashes of every full block of token_ids."""
        hashes: list[bytes] = []
        self.extend(hashes, token_ids, cache_salt)
        return hashes
