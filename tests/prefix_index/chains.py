"""Deterministic 16-byte block hashes for tests (the engine uses chained xxh3_128)."""

from __future__ import annotations

import xxhash

from prefix_index.api.ops import Commit


def block_hash(parent: bytes, label: str) -> bytes:
    return xxhash.xxh3_128_digest(parent + label.encode())


def make_chain(name: str, length: int) -> list[bytes]:
    chain, parent = [], b""
    for i in range(length):
        parent = block_hash(parent, f"{name}/{i}")
        chain.append(parent)
    return chain


def commit_ops(chain: list[bytes], first_block_id: int) -> list[Commit]:
    """Commit ops for a whole chain, block ids first_block_id, first_block_id+1, ..."""
    return [Commit(h, chain[i - 1] if i else b"", first_block_id + i)
            for i, h in enumerate(chain)]
