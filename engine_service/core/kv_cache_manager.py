"""Owns every sequence's block table and is the only code that changes block refcounts.

Sequences carry tokens and progress; their KV blocks live here, keyed by seq_id (device tables,
CPU tables while swapped, the block-hash chain and how much of it is committed). The scheduler
asks how many free blocks an action needs, then performs it; the runner reads tables through the
scheduled step (engine_service/core/scheduler_output.py).
"""

from collections import Counter, deque
from dataclasses import dataclass

from engine_service.core.block_hash import BlockHasher
from engine_service.core.block_pool import Block, BlockPool, blocks_for
from engine_service.core.scheduler_output import BlockMoves
from engine_service.core.sequence import Sequence


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, found in the cache


class KVCacheManager:
    def __init__(
        self,
        pool: BlockPool,
        hasher: BlockHasher,
        enable_prefix_caching: bool = True,
        num_cpu_blocks: int = 0,
    ) -> None:
        self.pool = pool
        self.hasher = hasher
        self.block_size = hasher.block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.stats = PrefixCacheStats()
        self._moves = BlockMoves()
        self._tables: dict[int, list[int]] = {}  # seq_id -> device block ids, logical order
        self._cpu_tables: dict[int, list[int]] = {}  # seq_id -> CPU block ids while swapped
        self._hashes: dict[int, list[bytes]] = {}  # seq_id -> chained hashes of full blocks
        self._num_committed: dict[int, int] = {}  # seq_id -> leading blocks in the cache
        self._cpu_free: deque[int] = deque(range(num_cpu_blocks))
        self.num_cpu_blocks = num_cpu_blocks

    # ---- reading ------------------------------------------------------------------------
    def block_table(self, seq: Sequence) -> list[int]:
        """seq's device blocks (the manager's own list: read, never change)."""
        return self._tables.get(seq.seq_id, [])

    def device_tables(self) -> dict[int, list[int]]:
        """Every device table by seq_id (for invariant checks)."""
        return self._tables

    def cpu_tables(self) -> dict[int, list[int]]:
        return self._cpu_tables

    def block_hashes(self, seq: Sequence, cache_salt: str | None) -> list[bytes]:
        hashes = self._hashes.setdefault(seq.seq_id, [])
        self.hasher.extend(hashes, seq.token_ids, cache_salt)
        return hashes

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self._cpu_free)

    def take_moves(self) -> BlockMoves:
        moves, self._moves = self._moves, BlockMoves()
        return moves

    # ---- prefix cache -------------------------------------------------------------------
    def cached_prefix(self, seq: Sequence, cache_salt: str | None) -> list[Block]:
        """Cached blocks for the longest prefix of seq's tokens (changes nothing). The block
        holding the last token is never taken: it is recomputed so the step has logits."""
        if not self.enable_prefix_caching:
            return []
        hashes = self.block_hashes(seq, cache_salt)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits = []
        for i, block_hash in enumerate(hashes[:max_blocks]):
            start = i * self.block_size
            block = self.pool.lookup(
                block_hash, tuple(seq.token_ids[start : start + self.block_size])
            )
            if block is None:
                break
            hits.append(block)
        return hits

    def blocks_in_flight(self, seq: Sequence) -> list[bytes]:
        """Hashes of seq's full blocks that hold device blocks but are not computed yet: what
        the step being planned computes, or a prefill chunk that stopped inside them. (Not
        the blocks a swap-in brings back: computed, committed again after the step.)"""
        if not self.enable_prefix_caching:
            return []
        hashes = self._hashes.get(seq.seq_id, [])
        num_held = min(len(self._tables.get(seq.seq_id, [])), len(hashes))
        num_computed = max(self._num_committed.get(seq.seq_id, 0),
                           seq.num_computed_tokens // self.block_size)
        return hashes[num_computed:num_held]

    def commit_full_blocks(self, seq: Sequence, cache_salt: str | None) -> None:
        """Register the blocks of seq that have become full and computed since the last call."""
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(seq.seq_id, [])
        num_full = min(seq.num_computed_tokens // self.block_size, len(table))
        done = self._num_committed.get(seq.seq_id, 0)
        if num_full <= done:
            return
        hashes = self.block_hashes(seq, cache_salt)
        for i in range(done, num_full):
            parent = hashes[i - 1] if i else None
            start = i * self.block_size
            tokens = tuple(seq.token_ids[start : start + self.block_size])
            self.pool.commit(table[i], hashes[i], parent, tokens)
        self._num_committed[seq.seq_id] = num_full

    # ---- admission ----------------------------------------------------------------------
    def blocks_to_admit(self, seq: Sequence, hits: list[Block], num_new_tokens: int) -> int:
        """Free blocks admitting seq with these cache hits and num_new_tokens would consume."""
        # Idle hits leave the evictable set, which the pool counts free; pinned idle ones are
        # not counted free (never taken by an allocation), so acquiring them costs nothing.
        policy = self.pool.policy
        idle_hits = sum(1 for b in hits
                        if b.ref_count == 0 and policy.is_evictable(b.block_hash))
        total = blocks_for(len(hits) * self.block_size + num_new_tokens, self.block_size)
        return idle_hits + max(0, total - len(hits))

    def admit(
        self, seq: Sequence, hits: list[Block], num_new_tokens: int, cache_salt: str | None
    ) -> None:
        """Give a waiting seq its cache hits (acquired first, so the allocation that follows
        can never evict them) and the blocks for num_new_tokens more. Check blocks_to_admit
        first. The scheduler sets num_computed_tokens to len(hits) * block_size."""
        if seq.seq_id in self._tables:
            raise RuntimeError(f"seq {seq.seq_id} is admitted already")
        if self.enable_prefix_caching:
            # The policy sees the whole query (the prefix index counts it as one admission and
            # acquires the held prefix in one op) before the hits are acquired.
            hashes = self.block_hashes(seq, cache_salt)
            max_blocks = (seq.num_tokens - 1) // self.block_size
            self.pool.policy.on_prefix_query(hashes[:max_blocks], len(hits))
        for block in hits:
            self.pool.acquire(block)
        table = [b.block_id for b in hits]
        self._tables[seq.seq_id] = table
        self._num_committed[seq.seq_id] = len(hits)
        total = blocks_for(len(hits) * self.block_size + num_new_tokens, self.block_size)
        if total > len(table):
            table.extend(b.block_id for b in self.pool.allocate(total - len(table)))

    def share_prefix(self, source: Sequence, target: Sequence, num_blocks: int) -> None:
        """target (holding nothing) shares source's first num_blocks computed blocks: the
        shared prompt of a re-admitted n > 1 group. Takes no free block."""
        table = self._tables[source.seq_id][:num_blocks]
        if len(table) != num_blocks or source.num_computed_tokens < num_blocks * self.block_size:
            raise RuntimeError(f"seq {source.seq_id} has not computed {num_blocks} blocks")
        if self._tables.get(target.seq_id):
            raise RuntimeError(f"seq {target.seq_id} holds blocks already")
        for block_id in table:
            self.pool.add_ref(block_id)
        self._tables[target.seq_id] = table
        self._num_committed[target.seq_id] = min(
            num_blocks, self._num_committed.get(source.seq_id, 0)
        )

    # ---- growth -------------------------------------------------------------------------
    def blocks_to_grow(self, plans: list[tuple[Sequence, int]]) -> int:
        """Free blocks that computing these (seq, num_new_tokens) plans would consume, exactly:
        new blocks, plus one copy per writer of a shared partial block except that a block whose
        every holder writes it this step is kept by the last of them."""
        needed = 0
        writers: Counter[int] | None = None  # made only for a shared partial block (rare)
        for seq, num_new in plans:
            table = self._tables.get(seq.seq_id, [])
            total = blocks_for(seq.num_computed_tokens + num_new, self.block_size)
            needed += max(0, total - len(table))
            shared = self._shared_partial_block(seq, table)
            if shared is not None:
                writers = writers if writers is not None else Counter()
                writers[shared] += 1
        for block_id, num_writers in (writers or {}).items():
            ref_count = self.pool.blocks[block_id].ref_count
            needed += num_writers if ref_count > num_writers else num_writers - 1
        return needed

    def table_for_decode(self, seq: Sequence) -> list[int] | None:
        """seq's table when its next token goes into a block it already holds alone (no new
        block, no copy-on-write: most decode steps), else None (use blocks_to_grow / grow).
        One call instead of a plan, blocks_to_grow and grow per sequence per step."""
        table = self._tables.get(seq.seq_id)
        computed = seq.num_computed_tokens
        offset = computed % self.block_size
        if table is None or offset == 0 or computed // self.block_size >= len(table):
            return None
        if self.pool.blocks[table[computed // self.block_size]].ref_count > 1:
            return None
        return table

    def _shared_partial_block(self, seq: Sequence, table: list[int]) -> int | None:
        """The block seq writes next, when it is partly filled and shared (copy-on-write)."""
        offset = seq.num_computed_tokens % self.block_size
        index = seq.num_computed_tokens // self.block_size
        if offset == 0 or index >= len(table):
            return None
        block_id = table[index]
        return block_id if self.pool.blocks[block_id].ref_count > 1 else None

    def grow(self, seq: Sequence, num_new_tokens: int) -> None:
        """The blocks for num_new_tokens more tokens of a running seq (check blocks_to_grow)."""
        table = self._tables.setdefault(seq.seq_id, [])
        shared_id = self._shared_partial_block(seq, table)
        if shared_id is not None:
            # The first write into a shared partial block gets a private copy.
            (fresh,) = self.pool.allocate(1)
            self._moves.copies.append((shared_id, fresh.block_id))
            self.pool.free([shared_id])
            table[seq.num_computed_tokens // self.block_size] = fresh.block_id
        total = blocks_for(seq.num_computed_tokens + num_new_tokens, self.block_size)
        if total > len(table):
            table.extend(b.block_id for b in self.pool.allocate(total - len(table)))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child shares every block of parent (parallel sampling)."""
        table = self._tables[parent.seq_id]
        for block_id in table:
            self.pool.add_ref(block_id)
        self._tables[child.seq_id] = list(table)
        self._hashes[child.seq_id] = list(self._hashes.get(parent.seq_id, []))
        self._num_committed[child.seq_id] = self._num_committed.get(parent.seq_id, 0)

    def free(self, seq: Sequence) -> None:
        """Release seq's device blocks (tail first, so chains are evicted leaf-first)."""
        table = self._tables.pop(seq.seq_id, None)
        self._num_committed.pop(seq.seq_id, None)
        if table:
            self.pool.free(table)

    def forget(self, seq: Sequence) -> None:
        """seq is gone for good (finished or aborted): drop everything kept for it."""
        if seq.seq_id in self._cpu_tables:
            raise RuntimeError(f"seq {seq.seq_id} is swapped out: free_cpu its group first")
        self.free(seq)
        self._hashes.pop(seq.seq_id, None)

    # ---- swapping -----------------------------------------------------------------------
    def can_swap_out(self, seqs: list[Sequence]) -> bool:
        distinct = {b for s in seqs for b in self._tables.get(s.seq_id, [])}
        return len(distinct) <= len(self._cpu_free)

    def swap_out(self, seqs: list[Sequence]) -> None:
        """Move the group's blocks to the CPU pool; shared blocks are copied once."""
        device_to_cpu: dict[int, int] = {}
        for seq in seqs:
            table = self._tables.pop(seq.seq_id, None)
            if table is None:
                continue  # parked: holds nothing
            self._num_committed.pop(seq.seq_id, None)  # the device copies may be evicted
            for block_id in table:
                if block_id not in device_to_cpu:
                    device_to_cpu[block_id] = self._cpu_free.popleft()
                    self._moves.swap_out.append((block_id, device_to_cpu[block_id]))
            self.pool.free(table)
            self._cpu_tables[seq.seq_id] = [device_to_cpu[b] for b in table]

    def blocks_to_swap_in(self, seqs: list[Sequence]) -> int:
        return len({b for s in seqs for b in self._cpu_tables.get(s.seq_id, [])})

    def swap_in(self, seqs: list[Sequence]) -> None:
        cpu_tables = {
            s.seq_id: self._cpu_tables.pop(s.seq_id) for s in seqs if s.seq_id in self._cpu_tables
        }
        cpu_ids = sorted({c for table in cpu_tables.values() for c in table})
        fresh = self.pool.allocate(len(cpu_ids))
        cpu_to_device = {c: b.block_id for c, b in zip(cpu_ids, fresh, strict=True)}
        holders = Counter(c for table in cpu_tables.values() for c in table)
        for seq_id, table in cpu_tables.items():
            self._tables[seq_id] = [cpu_to_device[c] for c in table]
            self._num_committed[seq_id] = 0
        for c in cpu_ids:
            for _ in range(holders[c] - 1):
                self.pool.add_ref(cpu_to_device[c])
            self._moves.swap_in.append((c, cpu_to_device[c]))
            self._cpu_free.append(c)

    def free_cpu(self, seqs: list[Sequence]) -> None:
        """Drop a swapped group's CPU blocks (shared ones once)."""
        cpu_ids = set()
        for seq in seqs:
            cpu_ids.update(self._cpu_tables.pop(seq.seq_id, []))
        self._cpu_free.extend(sorted(cpu_ids))

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.stats.queries += num_tokens
        self.stats.hits += num_hit_tokens
