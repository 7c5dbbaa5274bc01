"""The pool of physical KV blocks: refcounts, the free list and the prefix-cache hash map."""

import math
from collections import deque
from dataclasses import dataclass

from engine_service.core.prefix_policy import (
    LOCAL_PIN_BUDGET_FRACTION,
    LocalLRUPolicy,
    PrefixPolicy,
)


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold num_tokens tokens (the last one possibly partial)."""
    return -(-num_tokens // block_size)


class NoFreeBlocksError(RuntimeError):
    pass


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    # The tokens the hash stands for: compared on every hit, so a collision never shares KV.
    token_ids: tuple[int, ...] | None = None


class BlockPool:
    def __init__(self, num_blocks: int, policy: PrefixPolicy | None = None) -> None:
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_ids: deque[int] = deque(range(num_blocks))  # refcount 0 and not cached
        self._cached: dict[bytes, Block] = {}  # hash -> block, in use or evictable
        self.policy: PrefixPolicy = policy or LocalLRUPolicy(
            pin_budget=math.floor(LOCAL_PIN_BUDGET_FRACTION * num_blocks + 1e-9))

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: never used or cached with no user."""
        return len(self._free_ids) + self.policy.num_evictable

    def is_cached(self, block_hash: bytes) -> bool:
        return block_hash in self._cached

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def free_block_ids(self) -> list[int]:
        """Never-used (uncached, refcount 0) blocks, for invariant checks."""
        return list(self._free_ids)

    def cached_items(self) -> list[tuple[bytes, Block]]:
        """(hash, block) for every cached block, for invariant checks."""
        return list(self._cached.items())

    def allocate(self, num_blocks: int) -> list[Block]:
        if num_blocks > self.num_free_blocks:
            raise NoFreeBlocksError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        if len(self._free_ids) < num_blocks:
            self._evict(num_blocks - len(self._free_ids))
        allocated = []
        for _ in range(num_blocks):
            block = self.blocks[self._free_ids.popleft()]
            block.ref_count = 1
            allocated.append(block)
        return allocated

    def _evict(self, num_blocks: int) -> None:
        for block_hash in self.policy.pick_victims(num_blocks):
            block = self._cached.pop(block_hash)
            block.block_hash = None
            block.token_ids = None
            self._free_ids.append(block.block_id)

    def lookup(self, block_hash: bytes, token_ids: tuple[int, ...]) -> Block | None:
        """The cached block for this hash, only if it really holds these tokens."""
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != token_ids:
            return None
        return block

    def acquire(self, block: Block) -> None:
        """One more user of a cached block."""
        was_evictable = block.ref_count == 0
        block.ref_count += 1
        self.policy.on_acquire(block.block_hash, was_evictable)

    def add_ref(self, block_id: int) -> None:
        """One more user of a block already in use (fork)."""
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"fork of block {block_id} with refcount {block.ref_count}")
        block.ref_count += 1
        if block.block_hash is not None:
            self.policy.on_acquire(block.block_hash, False)

    def commit(self, block_id: int, block_hash: bytes, parent: bytes | None, tokens: tuple) -> bool:
        """Register a full block in the prefix cache. False when the hash is already cached
        (another sequence computed the same block): block tables stay append-only, so the
        duplicate simply stays private and returns to the free list when released."""
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self._cached:
            return False
        block.block_hash = block_hash
        block.token_ids = tokens
        self._cached[block_hash] = block
        self.policy.on_commit(block_hash, parent, block_id)
        return True

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block, tail first (so chains are evicted leaf-first)."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count < 0:
                raise RuntimeError(f"block {block_id} refcount went negative")
            if block.block_hash is not None:
                self.policy.on_release(block.block_hash, block.ref_count == 0)
            elif block.ref_count == 0:
                self._free_ids.append(block_id)

    def uncache(self, block_hash: bytes) -> bool:
        """Forget a cached block (the policy already dropped it, e.g. the prefix index evicted
        it): an idle block returns to the free list; one in use stays with its users as a
        private block. False when the hash is not cached."""
        block = self._cached.pop(block_hash, None)
        if block is None:
            return False
        block.block_hash = None
        block.token_ids = None
        if block.ref_count == 0:
            self._free_ids.append(block.block_id)
        return True

    def reset_prefix_cache(self) -> None:
        """Forget every evictable cached block (e.g. after the index fenced our epoch)."""
        self._evict(self.policy.num_evictable)
