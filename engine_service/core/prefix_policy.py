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

# Pins on an engine without the index, as a share of its pool: the index's default budget
# (pagedgen-prefix-index --pin-budget-fraction), so a prefix pinned on one fits on the other.
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

    def release_pins(self, num_blocks: int) -> int:
        """Unpin up to num_blocks idle pinned blocks (they become evictable); how many."""

    def evictable_hashes(self) -> list[bytes]:
        """The evictable set, eviction end first (for invariant checks)."""

    def on_prefix_query(self, chain: list[bytes], num_hit_blocks: int) -> None:
        """An admission looked up `chain` (the prompt's cacheable full blocks) and is about to
        acquire its first num_hit_blocks (the on_acquire calls that follow)."""

    def begin_step(self) -> None:
        """Called by the engine thread before scheduling a step."""

    def end_step(self) -> None:
        """Called by the engine thread after a step (also one that ran no forward)."""


class LocalLRUPolicy:
    """Least recently released first. The pool releases a sequence's blocks tail first, so
    within a chain the leaves reach the eviction end before their parents (leaf-first).

    Pins (PinPrefix on an engine without the index): a pinned block at refcount zero is held
    out of the evictable set, up to `pin_budget` pinned blocks, each until its TTL passes or
    it is unpinned. Only blocks the pool caches can be pinned (PinPrefix computes a prefix
    first when it is not resident: engine_service/serving/servicer.py)."""

    def __init__(self, pin_budget: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._evictable: OrderedDict[bytes, None] = OrderedDict()
        self._resident: set[bytes] = set()  # committed hashes the pool still caches
        self._pins: dict[bytes, float] = {}  # pinned hash -> expiry on `clock` (inf: none)
        self._pinned_idle: set[bytes] = set()  # pinned, refcount zero
        self.pin_budget = pin_budget
        self._clock = clock
        self._next_expiry = math.inf

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def on_commit(self, block_hash: bytes, parent_hash: bytes | None, block_id: int) -> None:
        self._resident.add(block_hash)

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
            victim = self._evictable.popitem(last=False)[0]
            self._resident.discard(victim)
            victims.append(victim)
        return victims

    @property
    def num_pinned_idle(self) -> int:
        return len(self._pinned_idle)

    @property
    def num_pinned(self) -> int:
        """Pinned blocks, idle or in use (what the budget counts)."""
        return len(self._pins)

    def release_pins(self, num_blocks: int) -> int:
        released = list(self._pinned_idle)[:num_blocks]
        for block_hash in released:
            self._unpin(block_hash)
        return len(released)

    def pin(self, chain: list[bytes], ttl_s: float, unpin: bool) -> int:
        """Pins the cached prefix of `chain` (its leading blocks the pool holds) for ttl_s
        seconds (0: until unpinned; a pin again renews it), or unpins the chain's pinned
        blocks; how many blocks it pinned or unpinned. PinBudgetFull when the new pins would
        pass the budget."""
        if unpin:
            return sum(self._unpin(h) for h in chain)
        held = []
        for block_hash in chain:
            if block_hash not in self._resident:
                break
            held.append(block_hash)
        new = sum(h not in self._pins for h in held)
        if len(self._pins) + new > self.pin_budget:
            raise PinBudgetFull(
                f"pinning {new} more blocks would pass the pin budget of {self.pin_budget} "
                f"blocks ({len(self._pins)} pinned; {LOCAL_PIN_BUDGET_FRACTION:.0%} of the pool)")
        expiry = self._clock() + ttl_s if ttl_s > 0 else math.inf
        for block_hash in held:
            self._pins[block_hash] = expiry
            if block_hash in self._evictable:
                del self._evictable[block_hash]
                self._pinned_idle.add(block_hash)
        self._next_expiry = min(self._next_expiry, expiry)
        return len(held)

    def _unpin(self, block_hash: bytes) -> bool:
        if self._pins.pop(block_hash, None) is None:
            return False
        if block_hash in self._pinned_idle:
            self._pinned_idle.remove(block_hash)
            self._evictable[block_hash] = None
        return True

    def _expire_pins(self) -> None:
        now = self._clock()
        if now < self._next_expiry:
            return
        for block_hash in [h for h, expiry in self._pins.items() if expiry <= now]:
            self._unpin(block_hash)
        self._next_expiry = min(self._pins.values(), default=math.inf)

    def evictable_hashes(self) -> list[bytes]:
        return list(self._evictable)

    def on_prefix_query(self, chain: list[bytes], num_hit_blocks: int) -> None:
        pass

    def begin_step(self) -> None:
        self._expire_pins()

    def end_step(self) -> None:
        pass
