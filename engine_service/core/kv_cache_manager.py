"""Hands out blocks to sequences: prefix-cache hits, appends, copy-on-write, fork, swap."""

from collections import deque
from dataclasses import dataclass, field

from engine_service.core.block_hash import extend_block_hashes
from engine_service.core.block_pool import Block, BlockPool
from engine_service.core.sequence import Sequence


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, found in the cache


@dataclass(slots=True)
class BlockMoves:
    """Block copies the model runner must perform before the step's forward."""

    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) on device (CoW)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, device)


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        seed_hash: bytes,
        enable_prefix_caching: bool = True,
        num_cpu_blocks: int = 0,
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.seed_hash = seed_hash
        self.enable_prefix_caching = enable_prefix_caching
        self.stats = PrefixCacheStats()
        self.moves = BlockMoves()
        self._cpu_free: deque[int] = deque(range(num_cpu_blocks))
        self.num_cpu_blocks = num_cpu_blocks

    # ---- prefix cache -------------------------------------------------------------------
    def find_cached_prefix(self, seq: Sequence, cache_salt: str | None) -> list[Block]:
        """Cached blocks for the longest prefix of seq's tokens. The block holding the last
        token is never taken: it is recomputed so the step has logits to sample from."""
        if not self.enable_prefix_caching:
            return []
        extend_block_hashes(
            seq.block_hashes, seq.token_ids, self.block_size, self.seed_hash, cache_salt
        )
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits = []
        for i, block_hash in enumerate(seq.block_hashes[:max_blocks]):
            start = i * self.block_size
            block = self.pool.lookup(
                block_hash, tuple(seq.token_ids[start : start + self.block_size])
            )
            if block is None:
                break
            hits.append(block)
        return hits

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.stats.queries += num_tokens
        self.stats.hits += num_hit_tokens

    def commit_full_blocks(self, seq: Sequence, cache_salt: str | None) -> None:
        """Register the blocks that have become full and computed since the last call."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if num_full <= seq.num_committed_blocks:
            return
        extend_block_hashes(
            seq.block_hashes, seq.token_ids, self.block_size, self.seed_hash, cache_salt
        )
        for i in range(seq.num_committed_blocks, num_full):
            parent = seq.block_hashes[i - 1] if i else None
            start = i * self.block_size
            tokens = tuple(seq.token_ids[start : start + self.block_size])
            self.pool.commit(seq.block_table[i], seq.block_hashes[i], parent, tokens)
        seq.num_committed_blocks = num_full

    # ---- allocation ---------------------------------------------------------------------
    def blocks_needed(self, seq: Sequence, num_new_tokens: int, cached: list[Block]) -> int:
        """Free blocks that scheduling num_new_tokens more tokens of seq would consume."""
        num_table_blocks = max(len(seq.block_table), len(cached))
        total = blocks_for(seq.num_computed_tokens + num_new_tokens, self.block_size)
        needed = max(0, total - num_table_blocks)
        needed += sum(1 for b in cached if b.ref_count == 0)  # leaves the evictable set
        if self._needs_copy_on_write(seq):
            needed += 1
        return needed

    def _needs_copy_on_write(self, seq: Sequence) -> bool:
        offset = seq.num_computed_tokens % self.block_size
        index = seq.num_computed_tokens // self.block_size
        if offset == 0 or index >= len(seq.block_table):
            return False
        return self.pool.blocks[seq.block_table[index]].ref_count > 1

    def allocate(self, seq: Sequence, num_new_tokens: int, cached: list[Block]) -> None:
        """Give seq the blocks for num_new_tokens more tokens (check blocks_needed first)."""
        if self.enable_prefix_caching and not seq.block_table and seq.num_computed_tokens == 0:
            # An admission: the policy sees the whole query (the prefix index counts it and
            # acquires the held prefix in one batched op) before the hits are acquired.
            max_blocks = (seq.num_tokens - 1) // self.block_size
            self.pool.policy.on_prefix_query(seq.block_hashes[:max_blocks], len(cached))
        if cached and not seq.block_table:
            for block in cached:
                self.pool.acquire(block)
            seq.block_table = [b.block_id for b in cached]
            seq.num_computed_tokens = len(cached) * self.block_size
            seq.num_committed_blocks = len(cached)
        if self._needs_copy_on_write(seq):
            # The first write into a shared partial block gets a private copy.
            index = seq.num_computed_tokens // self.block_size
            shared_id = seq.block_table[index]
            (fresh,) = self.pool.allocate(1)
            self.moves.copies.append((shared_id, fresh.block_id))
            self.pool.free([shared_id])
            seq.block_table[index] = fresh.block_id
        total = blocks_for(seq.num_computed_tokens + num_new_tokens, self.block_size)
        missing = total - len(seq.block_table)
        if missing > 0:
            seq.block_table.extend(b.block_id for b in self.pool.allocate(missing))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child shares every block of parent (parallel sampling)."""
        for block_id in parent.block_table:
            self.pool.add_ref(block_id)
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_committed_blocks = parent.num_committed_blocks
        child.num_computed_tokens = parent.num_computed_tokens

    def free(self, seq: Sequence) -> None:
        self.pool.free(seq.block_table)
        seq.block_table = []
        seq.num_committed_blocks = 0

    # ---- swapping -----------------------------------------------------------------------
    def can_swap_out(self, seqs: list[Sequence]) -> bool:
        distinct = {b for s in seqs for b in s.block_table}
        return len(distinct) <= len(self._cpu_free)

    def swap_out(self, seqs: list[Sequence]) -> None:
        """Move the group's blocks to the CPU pool; shared blocks are copied once."""
        device_to_cpu: dict[int, int] = {}
        for seq in seqs:
            for block_id in seq.block_table:
                if block_id not in device_to_cpu:
                    device_to_cpu[block_id] = self._cpu_free.popleft()
                    self.moves.swap_out.append((block_id, device_to_cpu[block_id]))
            self.pool.free(seq.block_table)
            seq.block_table = [device_to_cpu[b] for b in seq.block_table]
            seq.num_committed_blocks = 0  # the device copies may be evicted meanwhile

    def blocks_to_swap_in(self, seqs: list[Sequence]) -> int:
        return len({b for s in seqs for b in s.block_table})

    def swap_in(self, seqs: list[Sequence]) -> None:
        cpu_ids = sorted({b for s in seqs for b in s.block_table})
        fresh = self.pool.allocate(len(cpu_ids))
        cpu_to_device = {c: b.block_id for c, b in zip(cpu_ids, fresh, strict=True)}
        refs = {c: 0 for c in cpu_ids}
        for seq in seqs:
            for c in seq.block_table:
                refs[c] += 1
            seq.block_table = [cpu_to_device[c] for c in seq.block_table]
        for c, count in refs.items():
            for _ in range(count - 1):
                self.pool.add_ref(cpu_to_device[c])
            self.moves.swap_in.append((c, cpu_to_device[c]))
            self._cpu_free.append(c)

    def free_cpu(self, seqs: list[Sequence]) -> None:
        for cpu_id in {b for s in seqs for b in s.block_table}:
            self._cpu_free.append(cpu_id)
        for seq in seqs:
            seq.block_table = []

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self._cpu_free)

    def take_moves(self) -> BlockMoves:
        moves, self.moves = self.moves, BlockMoves()
        return moves
