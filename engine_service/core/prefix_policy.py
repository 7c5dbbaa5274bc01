"""Policy for cached prefix blocks: which may be shared and which are evicted first.

The block pool owns the mechanism (refcounts, the free list, the hash map, token verification);
a policy only orders the evictable cached blocks. The local policy is an O(1) LRU; a policy
steered by the prefix index service mirrors these calls to it (engine_service/index/policy.py).
"""

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from engine_service.core.pin_set import PinSet

# Pins on a pool without an engine, as a share of it: the index's default budget
# (pagedgen-prefix-index --pin-budget-fraction). An engine sets its policy's budget from the
# demand (core/pin_budget.py), with this as its default floor.
LOCAL_PIN_BUDGET_FRACTION = 0.1


class PinBudgetFull(Exception):
    """A local pin would pass the pin budget (nothing was pinned)."""


class PrefixPolicy(Protocol):
    @property
    def num_evictable(self) -> int: ...

    def on_commit(self, block_hash: bytes, parent_hash: bytes | None, block_id: int) -> None:
        """A full block's hash was registered (its refcount is >= 1)."""

    def on_acquire(self, block_hash: bytes, was_evictable: bool) -> None:
        """A cached block got one more user."""

    def on_release(self, block_hash: bytes, now_evictable: bool) -> None:
        """A cached block lost a user; at refcount zero it becomes evictable."""

    def pick_victims(self, num_blocks: int) -> list[bytes]:
        """Up to num_blocks evictable hashes to reclaim, removed from the policy."""

    @property
    def num_pinned_idle(self) -> int:
        """Cached blocks with refcount 0 that a pin keeps out of the evictable set."""

    def is_evictable(self, block_hash: bytes) -> bool:
        """In the evictable set (refcount 0 and not pinned): counted free by the pool."""

    def is_pinned(self, block_hash: bytes) -> bool:
        """A pin holds this cached block (idle or in use)."""

    @property
    def num_pinned(self) -> int:
        """Pinned blocks, idle or in use (what the pin budget counts)."""

    def release_pins(self, num_blocks: int) -> int:
        """Unpin up to num_blocks idle pinned blocks (they become evictable); how many."""

    def evictable_hashes(self) -> list[bytes]:
        """The evictable set, eviction end first (for invariant checks)."""

    def on_prefix_query(self, chain: list[bytes], num_hit_blocks: int) -> None:
        """An admission looked up `chain` (the prompt's cacheable full blocks) and is about to
        acquire its first num_hit_blocks (the on_acquire calls that follow)."""

    def begin_step(self) -> None:
        """Called by the engine thread before scheduling a step."""

    def lapse_pins(self) -> bool:
        """Drops the pins whose TTL ran out; True when any did. begin_step does it, and the
        engine thread between steps too: an idle engine takes none, and a pin that lapsed
        must not stay counted (in its stats, against the index's) until the next request."""

    def end_step(self) -> None:
        """Called by the engine thread after a step (also one that ran no forward)."""

    def set_pin_budget(self, blocks: int) -> None:
        """How many blocks pins may hold now (the engine's core/pin_budget.py decides)."""


class LocalLRUPolicy:
    """Least recently released first. The pool releases a sequence's blocks tail first, so
    within a chain the leaves reach the eviction end before their parents (leaf-first).

    Pins (PinPrefix on an engine without the index, core/pin_set.py): a pinned block at
    refcount zero is held out of the evictable set, up to `pin_budget` pinned blocks (the
    engine's core/pin_budget.py sets it; a smaller budget refuses new pins and drops none),
    until every pin covering it is unpinned or lapses. Only blocks the pool caches can be pinned
    (PinPrefix computes a prefix first when it is not resident: serving/prefix_pins.py)."""

    def __init__(self, pin_budget: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._evictable: OrderedDict[bytes, None] = OrderedDict()
        self._pins = PinSet()
        self._pinned_idle: set[bytes] = set()  # pinned, refcount zero
        self.pin_budget = pin_budget
        self._clock = clock

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def on_commit(self, block_hash: bytes, parent_hash: bytes | None, block_id: int) -> None:
        pass

    def on_acquire(self, block_hash: bytes, was_evictable: bool) -> None:
        if not was_evictable:
            return
        if block_hash in self._pinned_idle:
            self._pinned_idle.remove(block_hash)
        else:
            del self._evictable[block_hash]

    def on_release(self, block_hash: bytes, now_evictable: bool) -> None:
        if not now_evictable:
            return
        if block_hash in self._pins:
            self._pinned_idle.add(block_hash)
        else:
            self._evictable[block_hash] = None

    def pick_victims(self, num_blocks: int) -> list[bytes]:
        victims = []
        while self._evictable and len(victims) < num_blocks:
            victims.append(self._evictable.popitem(last=False)[0])
        return victims

    @property
    def num_pinned_idle(self) -> int:
        return len(self._pinned_idle)

    def is_evictable(self, block_hash: bytes) -> bool:
        return block_hash in self._evictable

    def is_pinned(self, block_hash: bytes) -> bool:
        return block_hash in self._pins

    @property
    def num_pinned(self) -> int:
        """Pinned blocks, idle or in use (what the budget counts)."""
        return len(self._pins)

    def release_pins(self, num_blocks: int) -> int:
        """Whole pins, least recently pinned first, until num_blocks idle blocks are free to
        evict (a lone request needs the room); how many idle blocks that freed."""
        freed = 0
        while freed < num_blocks and self._pinned_idle:
            freed += self._unpinned(self._pins.unpin_oldest())
        return freed

    def pin(self, chain: list[bytes], ttl_s: float, unpin: bool,
            is_cached: Callable[[bytes], bool]) -> int:
        """Pins the cached prefix of `chain` (its leading blocks for which `is_cached`, the
        pool's BlockPool.is_cached, holds) for ttl_s seconds (0: until unpinned), as one pin
        named by the chain's last hash (pinned again: the later expiry is kept); or drops
        that pin. How many blocks the pin covers, or, for an unpin, how many blocks are no
        longer pinned by any pin. PinBudgetFull when the new blocks would pass the budget
        (nothing pinned)."""
        if not chain:
            return 0
        if unpin:
            return self._unpinned(self._pins.unpin(chain[-1]))
        held = []
        for block_hash in chain:
            if not is_cached(block_hash):
                break
            held.append(block_hash)
        self.check_pin(held)
        expires_at = self._clock() + ttl_s if ttl_s > 0 else math.inf
        added, dropped = self._pins.pin(chain[-1], held, expires_at)
        for block_hash in added:
            if block_hash in self._evictable:
                del self._evictable[block_hash]
                self._pinned_idle.add(block_hash)
        self._unpinned(dropped)
        return len(held)

    def check_pin(self, chain: list[bytes]) -> None:
        """PinBudgetFull when pinning all of `chain` would pass the budget. A pin that adds
        no block (renewing its TTL) passes: pins over a budget that shrank under them stay,
        and they must be renewable or a shrink would drop them when their TTL lapses."""
        self.lapse_pins()  # (a pin that lapsed since the last step holds no room)
        new = self._pins.num_new(chain)
        if new and len(self._pins) + new > self.pin_budget:
            raise PinBudgetFull(
                f"pinning {new} more blocks would pass the pin budget of {self.pin_budget} "
                f"blocks ({len(self._pins)} pinned; the budget is what the pool can spare "
                "beside the running requests, within --pin-budget-floor/--pin-budget-ceiling)")

    def _unpinned(self, hashes: list[bytes]) -> int:
        """Blocks no pin covers any more (leaf first): idle ones become evictable as if just
        released, leaf before parent. How many were idle."""
        freed = 0
        for block_hash in hashes:
            if block_hash in self._pinned_idle:
                self._pinned_idle.remove(block_hash)
                self._evictable[block_hash] = None
                freed += 1
        return freed

    def evictable_hashes(self) -> list[bytes]:
        return list(self._evictable)

    def on_prefix_query(self, chain: list[bytes], num_hit_blocks: int) -> None:
        pass

    def begin_step(self) -> None:
        self.lapse_pins()

    def lapse_pins(self) -> bool:
        lapsed = self._pins.expire(self._clock())
        self._unpinned(lapsed)
        return bool(lapsed)

    def end_step(self) -> None:
        pass

    def set_pin_budget(self, blocks: int) -> None:
        self.pin_budget = blocks
