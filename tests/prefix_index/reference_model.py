"""A plain in-memory model of the index policy for one engine, to check the service against.

Same rules, written the obvious way (linear scans, no Redis): acquire takes the held prefix,
commit refuses reused block ids / existing hashes / missing parents, release stops at the first
bad hash, evict takes the least recently used block with refcount 0, no pin and no held
children, pins count against the budget, and a block pins itself once its hits reach the
threshold (the model assumes the hit window never rolls over during a test).
"""

from __future__ import annotations

from dataclasses import dataclass

from prefix_index.api.ops import (
    Acquire,
    Commit,
    Evict,
    EvictedBlock,
    Op,
    OpResult,
    OpStatus,
    Pin,
    Release,
    Unpin,
)


@dataclass(slots=True)
class ModelBlock:
    block_id: int
    parent: bytes
    refcount: int = 1
    last_use: int = 0
    pin: str = ""  # "", "e" (explicit) or "a" (automatic)
    hits: int = 0


class ReferenceIndex:
    def __init__(self, num_blocks: int, pin_budget: int, hot_threshold: int) -> None:
        self.num_blocks = num_blocks
        self.pin_budget = pin_budget
        self.hot_threshold = hot_threshold
        self.blocks: dict[bytes, ModelBlock] = {}
        self.clock = 0
        self.queries = 0
        self.hits = 0
        self.evictions = 0

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def held_prefix(self, chain: list[bytes]) -> list[bytes]:
        prefix = []
        for h in chain:
            if h not in self.blocks:
                break
            prefix.append(h)
        return prefix

    def _pinned(self) -> int:
        return sum(1 for b in self.blocks.values() if b.pin)

    def _has_children(self, h: bytes) -> bool:
        return any(b.parent == h for b in self.blocks.values())

    def owner_of(self, block_id: int) -> bytes | None:
        for h, b in self.blocks.items():
            if b.block_id == block_id:
                return h
        return None

    def apply(self, op: Op) -> OpResult:
        match op:
            case Acquire(chain=chain):
                prefix = self.held_prefix(chain)
                for h in prefix:
                    b = self.blocks[h]
                    b.refcount += 1
                    b.last_use = self._tick()
                    if self.hot_threshold > 0:
                        b.hits += 1
                        if (b.hits >= self.hot_threshold and not b.pin
                                and self._pinned() < self.pin_budget):
                            b.pin = "a"
                self.queries += len(chain)
                self.hits += len(prefix)
                ids = [self.blocks[h].block_id for h in prefix]
                return OpResult(OpStatus.OK, block_ids=ids, count=len(ids))
            case Commit(hash=h, parent=parent, block_id=block_id):
                if h in self.blocks:
                    existing = self.blocks[h].block_id
                    status = (OpStatus.ALREADY_COMMITTED if existing == block_id
                              else OpStatus.HASH_EXISTS)
                    return OpResult(status, block_ids=[existing])
                if parent and parent not in self.blocks:
                    return OpResult(OpStatus.NOT_HELD)
                if self.owner_of(block_id) is not None:
                    return OpResult(OpStatus.BLOCK_IN_USE)
                self.blocks[h] = ModelBlock(block_id, parent, last_use=self._tick())
                return OpResult(OpStatus.OK, block_ids=[block_id], count=1)
            case Release(hashes=hashes):
                count = 0
                for h in hashes:
                    b = self.blocks.get(h)
                    if b is None:
                        return OpResult(OpStatus.NOT_HELD, count=count)
                    if b.refcount == 0:
                        return OpResult(OpStatus.REFCOUNT_ZERO, count=count)
                    b.refcount -= 1
                    b.last_use = self._tick()
                    count += 1
                return OpResult(OpStatus.OK, count=count)
            case Evict(k=k):
                evicted = []
                while len(evicted) < k:
                    candidates = [(b.last_use, h) for h, b in self.blocks.items()
                                  if b.refcount == 0 and not b.pin and not self._has_children(h)]
                    if not candidates:
                        break
                    _, h = min(candidates)
                    evicted.append(EvictedBlock(h, self.blocks.pop(h).block_id))
                self.evictions += len(evicted)
                return OpResult(OpStatus.OK, evicted=evicted, count=len(evicted))
            case Pin(chain=chain):
                prefix = self.held_prefix(chain)
                new_pins = sum(1 for h in prefix if not self.blocks[h].pin)
                if self._pinned() + new_pins > self.pin_budget:
                    return OpResult(OpStatus.PIN_BUDGET_EXCEEDED)
                for h in prefix:
                    self.blocks[h].pin = "e"
                return OpResult(OpStatus.OK, count=len(prefix))
            case Unpin(chain=chain):
                count = 0
                for h in chain:
                    b = self.blocks.get(h)
                    if b is not None and b.pin:
                        b.pin = ""
                        count += 1
                return OpResult(OpStatus.OK, count=count)
        raise TypeError(f"not an op: {op!r}")

    def counters(self) -> dict[str, int]:
        return {
            "blocks": len(self.blocks),
            "evictable": sum(1 for b in self.blocks.values() if b.refcount == 0 and not b.pin),
            "pinned": self._pinned(),
            "auto_pinned": sum(1 for b in self.blocks.values() if b.pin == "a"),
            "queries": self.queries,
            "hits": self.hits,
            "evictions": self.evictions,
        }
