"""The invariants of the block pool and the block tables, checked by tests after every step.

- every block's refcount equals the table slots that hold it;
- a block in two tables sits at the same logical position in both, and the sequences agree on
  the tokens it holds (and on its hash when it is cached);
- no block is both free and referenced; the free count is the free list plus the evictable set;
- every cached hash maps to a block carrying that hash and its tokens;
- CPU blocks are either free or in swapped tables, never both.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

from engine_service.core.sequence import SequenceStatus

if TYPE_CHECKING:
    from engine_service.core.engine import LLMEngine


def block_problems(engine: LLMEngine) -> list[str]:
    pool, kv = engine.pool, engine.kv
    bs = kv.block_size
    seqs = {s.seq_id: s for g in engine._groups.values() for s in g.seqs}
    problems: list[str] = []
    holders: dict[int, list[tuple[int, int]]] = defaultdict(list)  # block -> (seq_id, position)
    for seq_id, table in kv.device_tables().items():
        seq = seqs.get(seq_id)
        if seq is None:
            problems.append(f"seq {seq_id} holds blocks {table} but belongs to no live request")
            continue
        if seq.status not in (SequenceStatus.RUNNING,):
            problems.append(f"seq {seq_id} is {seq.status.value} but holds device blocks {table}")
        if len(table) * bs < seq.num_computed_tokens:
            problems.append(f"seq {seq_id} computed {seq.num_computed_tokens} tokens in only "
                            f"{len(table)} blocks")
        if len(set(table)) != len(table):
            problems.append(f"seq {seq_id} holds a block twice: {table}")
        for position, block_id in enumerate(table):
            holders[block_id].append((seq_id, position))
    for block in pool.blocks:
        held = holders.get(block.block_id, [])
        if block.ref_count != len(held):
            problems.append(f"block {block.block_id} has refcount {block.ref_count} but "
                            f"{len(held)} table slots hold it: {held}")
        if not held:
            continue
        positions = {position for _, position in held}
        if len(positions) > 1:
            problems.append(f"block {block.block_id} sits at positions {sorted(positions)} of "
                            f"the tables of seqs {[s for s, _ in held]}")
            continue
        (position,) = positions
        start = position * bs
        computed = min(seqs[s].num_computed_tokens for s, _ in held)
        end = min(start + bs, computed)
        contents = {tuple(seqs[s].token_ids[start:end]) for s, _ in held}
        if end > start and len(contents) > 1:
            problems.append(f"block {block.block_id} is shared by seqs {[s for s, _ in held]} "
                            f"that disagree on its tokens {sorted(contents)}")
        if block.block_hash is not None:
            for seq_id, _ in held:
                seq = seqs[seq_id]
                tokens = tuple(seq.token_ids[start : start + bs])
                if seq.num_computed_tokens >= start + bs and tokens != block.token_ids:
                    problems.append(f"cached block {block.block_id} holds other tokens than "
                                    f"seq {seq_id} at position {position}")
                hashes = kv.block_hashes(seq, _salt(engine, seq_id))
                if position < len(hashes) and hashes[position] != block.block_hash:
                    problems.append(f"cached block {block.block_id} has another hash than "
                                    f"seq {seq_id}'s chain at position {position}")
    free_ids = set(pool.free_block_ids())
    if len(free_ids) != len(pool.free_block_ids()):
        problems.append("a block is on the free list twice")
    for block_id in free_ids:
        block = pool.blocks[block_id]
        if block.ref_count or block.block_hash is not None:
            problems.append(f"free block {block_id} has refcount {block.ref_count} and hash "
                            f"{block.block_hash!r}")
    cached = dict(pool.cached_items())
    for block_hash, block in cached.items():
        if block.block_hash != block_hash or block.token_ids is None:
            problems.append(f"cache maps a hash to block {block.block_id}, which carries "
                            f"another hash or no tokens")
        if block.block_id in free_ids:
            problems.append(f"cached block {block.block_id} is also on the free list")
    evictable = pool.policy.evictable_hashes()
    for block_hash in evictable:
        block = cached.get(block_hash)
        if block is None:
            problems.append("the policy holds an evictable hash the pool does not cache")
        elif block.ref_count:
            problems.append(f"block {block.block_id} is evictable with refcount "
                            f"{block.ref_count}")
    idle_cached = sum(1 for b in cached.values() if b.ref_count == 0)
    if idle_cached != len(evictable) + pool.policy.num_pinned_idle:
        problems.append(f"{idle_cached} cached blocks are idle but the policy counts "
                        f"{len(evictable)} evictable and {pool.policy.num_pinned_idle} pinned")
    if pool.num_free_blocks != len(free_ids) + len(evictable):
        problems.append(f"num_free_blocks {pool.num_free_blocks} is not the free list "
                        f"{len(free_ids)} + evictable {len(evictable)}")
    cpu_held = [c for table in kv.cpu_tables().values() for c in set(table)]
    cpu_free = kv.num_free_cpu_blocks
    if len(set(cpu_held)) + cpu_free != kv.num_cpu_blocks:
        problems.append(f"CPU blocks: {len(set(cpu_held))} held + {cpu_free} free != "
                        f"{kv.num_cpu_blocks}")
    return problems


def _salt(engine: LLMEngine, seq_id: int) -> str | None:
    for group in engine._groups.values():
        if any(s.seq_id == seq_id for s in group.seqs):
            return group.cache_salt
    return None
