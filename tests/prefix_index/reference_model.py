"""A plain in-memory model of the index policy for one engine, to check the service against.

Same rules, written the obvious way (linear scans, no Redis): acquire takes the held prefix,
commit refuses reused block ids / existing hashes / missing parents, release stops at the first
bad hash, evict takes the least recently used block with refcount 0, no pin and no held
children, forget drops exactly the named (hash, block), pins count against the budget.

Explicit pins are whole pins: a pin is named by the last hash of the chain it was asked for
and covers the chain's held prefix; a held block is pinned while any pin covers it (also when
it is committed again after being dropped); a pin again keeps the later expiry; unpin drops
that pin (and the automatic pins among the chain's blocks); expiry drops the pins whose time
(the model's `now`, which the caller moves) has come, at the start of each Apply.

Hit history: an admission counts one use of every hash of its chain, held or not, and the
counts outlive eviction; the history keeps the `history_cap` hashes used most recently (a
chain's leaf counts as used before its root). A held block pins itself once its uses reach
the threshold (at the admission, or when it is committed again). The model assumes the hit
window never rolls over during a test, so a use estimate is a plain count.

Every pin state transition is recorded; apply_batch hands them over like ApplyResponse.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prefix_index.api.ops import (
    Acquire,
    AcquireKind,
    Commit,
    Evict,
    EvictedBlock,
    Forget,
    Op,
    OpResult,
    OpStatus,
    Pin,
    PinChange,
    PinState,
    Release,
    Unpin,
)

_STATE = {"": PinState.NONE, "e": PinState.EXPLICIT, "a": PinState.AUTOMATIC}


@dataclass(slots=True)
class ModelBlock:
    block_id: int
    parent: bytes
    refcount: int = 1
    last_use: int = 0
    pin: str = ""  # "", "e" (explicit) or "a" (automatic)


@dataclass(slots=True)
class ModelPin:
    hashes: tuple[bytes, ...]  # the held prefix at its last pinning, root first
    expires_at: float  # on the model's clock; inf: until unpinned


@dataclass(slots=True)
class HistoryEntry:
    uses: int
    tick: int  # trim order: the smallest goes first


class ReferenceIndex:
    def __init__(self, num_blocks: int, pin_budget: int, hot_threshold: int,
                 history_cap: int) -> None:
        self.num_blocks = num_blocks
        self.pin_budget = pin_budget
        self.hot_threshold = hot_threshold
        self.history_cap = history_cap
        self.blocks: dict[bytes, ModelBlock] = {}
        self.history: dict[bytes, HistoryEntry] = {}
        self.pin_changes: dict[bytes, str] = {}
        self.pins: dict[bytes, ModelPin] = {}  # explicit pins by name
        self.now = 0.0  # the pins' clock (seconds), moved by the caller
        self.clock = 0
        self.history_clock = 0
        self.queries = 0
        self.hits = 0
        self.evictions = 0
        self.forgets = 0
        self.trimmed = 0  # history entries dropped at the cap

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

    def covers(self, h: bytes) -> int:
        """How many pins cover `h` (held or not)."""
        return sum(h in p.hashes for p in self.pins.values())

    def _uncovered(self, hashes: tuple[bytes, ...]) -> int:
        """Unpins the held blocks of `hashes` that no pin covers now; how many."""
        count = 0
        for h in reversed(hashes):
            b = self.blocks.get(h)
            if b is not None and b.pin == "e" and not self.covers(h):
                self._set_pin(h, "")
                count += 1
        return count

    def _drop_pin(self, name: bytes) -> int:
        pin = self.pins.pop(name, None)
        return 0 if pin is None else self._uncovered(pin.hashes)

    def expire(self) -> None:
        """What every Apply does first: drop the pins whose time has come."""
        for name in [n for n, p in self.pins.items() if p.expires_at <= self.now]:
            self._drop_pin(name)

    def _has_children(self, h: bytes) -> bool:
        return any(b.parent == h for b in self.blocks.values())

    def owner_of(self, block_id: int) -> bytes | None:
        for h, b in self.blocks.items():
            if b.block_id == block_id:
                return h
        return None

    def _set_pin(self, h: bytes, pin: str) -> None:
        if self.blocks[h].pin != pin:
            self.blocks[h].pin = pin
            self.pin_changes[h] = pin

    def _maybe_auto_pin(self, h: bytes, uses: int) -> None:
        if (self.hot_threshold > 0 and uses >= self.hot_threshold and not self.blocks[h].pin
                and self._pinned() < self.pin_budget):
            self._set_pin(h, "a")

    def _count_uses(self, chain: list[bytes]) -> list[int]:
        n = len(chain)
        counts = []
        for i, h in enumerate(chain):
            entry = self.history.setdefault(h, HistoryEntry(0, 0))
            entry.uses += 1
            entry.tick = self.history_clock + n - i
            counts.append(entry.uses)
        self.history_clock += n
        while len(self.history) > self.history_cap:
            oldest = min(self.history, key=lambda k: self.history[k].tick)
            del self.history[oldest]
            self.trimmed += 1
        return counts

    def _drop(self, h: bytes) -> ModelBlock:
        block = self.blocks.pop(h)
        if block.pin:
            self.pin_changes[h] = ""
        return block

    def apply(self, op: Op) -> OpResult:
        match op:
            case Acquire(chain=chain, kind=kind):
                prefix = self.held_prefix(chain)
                for h in prefix:
                    b = self.blocks[h]
                    b.refcount += 1
                    b.last_use = self._tick()
                if kind == AcquireKind.ADMISSION:
                    if self.hot_threshold > 0:
                        uses = self._count_uses(chain)
                        for i, h in enumerate(prefix):
                            self._maybe_auto_pin(h, uses[i])
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
                if self.covers(h):
                    # A pin covering it outlived its drop: it holds it again; automatic pins
                    # give way to keep the budget, least recently used first, as far as they can.
                    over = self._pinned() + 1 - self.pin_budget
                    autos = sorted((b.last_use, a) for a, b in self.blocks.items() if b.pin == "a")
                    for _, a in autos[:max(over, 0)]:
                        self._set_pin(a, "")
                    self._set_pin(h, "e")
                else:
                    entry = self.history.get(h)
                    self._maybe_auto_pin(h, entry.uses if entry else 0)
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
                    evicted.append(EvictedBlock(h, self._drop(h).block_id))
                self.evictions += len(evicted)
                return OpResult(OpStatus.OK, evicted=evicted, count=len(evicted))
            case Forget(hash=h, block_id=block_id):
                b = self.blocks.get(h)
                if b is None:
                    return OpResult(OpStatus.NOT_HELD)
                if b.block_id != block_id:
                    return OpResult(OpStatus.BLOCK_MISMATCH, block_ids=[b.block_id])
                self._drop(h)
                self.forgets += 1
                return OpResult(OpStatus.OK, block_ids=[block_id], count=1)
            case Pin(chain=chain, ttl_s=ttl_s):
                prefix = self.held_prefix(chain)
                if not prefix:
                    return OpResult(OpStatus.OK)
                old = self.pins.get(chain[-1])
                if old is None and len(self.pins) >= self.num_blocks:
                    return OpResult(OpStatus.PIN_BUDGET_EXCEEDED)
                new_pins = sum(1 for h in prefix if not self.blocks[h].pin)
                over = self._pinned() + new_pins - self.pin_budget
                if over > 0 and new_pins > 0:  # a renewal adds no pin: never refused
                    # Automatic pins outside the prefix make room, least recently used first.
                    autos = sorted((b.last_use, h) for h, b in self.blocks.items()
                                   if b.pin == "a" and h not in prefix)
                    if len(autos) < over:
                        return OpResult(OpStatus.PIN_BUDGET_EXCEEDED)
                    for _, h in autos[:over]:
                        self._set_pin(h, "")
                expires_at = self.now + ttl_s if ttl_s > 0 else math.inf
                if old is not None:
                    expires_at = max(expires_at, old.expires_at)
                self.pins[chain[-1]] = ModelPin(tuple(prefix), expires_at)
                for h in prefix:
                    self._set_pin(h, "e")
                if old is not None:
                    self._uncovered(old.hashes)
                return OpResult(OpStatus.OK, count=len(prefix))
            case Unpin(chain=chain, automatic_only=automatic_only):
                if not chain:
                    return OpResult(OpStatus.OK)
                count = 0 if automatic_only else self._drop_pin(chain[-1])
                for h in chain:
                    b = self.blocks.get(h)
                    if b is not None and b.pin == "a":
                        self._set_pin(h, "")
                        count += 1
                return OpResult(OpStatus.OK, count=count)
        raise TypeError(f"not an op: {op!r}")

    def apply_batch(self, ops: list[Op]) -> tuple[list[OpResult], list[PinChange]]:
        """Like one Apply: the results, then the pin changes since the previous batch."""
        self.expire()
        results = [self.apply(op) for op in ops]
        return results, self.take_pin_changes()

    def take_pin_changes(self) -> list[PinChange]:
        changes = [PinChange(h, self.blocks[h].block_id if h in self.blocks else -1,
                             _STATE[state])
                   for h, state in sorted(self.pin_changes.items())]
        self.pin_changes.clear()
        return changes

    def counters(self) -> dict[str, int]:
        return {
            "blocks": len(self.blocks),
            "evictable": sum(1 for b in self.blocks.values() if b.refcount == 0 and not b.pin),
            "pinned": self._pinned(),
            "auto_pinned": sum(1 for b in self.blocks.values() if b.pin == "a"),
            "queries": self.queries,
            "hits": self.hits,
            "evictions": self.evictions,
            "forgets": self.forgets,
            "history": len(self.history),
        }
