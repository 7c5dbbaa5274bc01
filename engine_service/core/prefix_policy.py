"""Policy for cached prefix blocks: which may be shared and which are evicted first.

The block pool owns the mechanism (refcounts, the free list, the hash map, token verification);
a policy only orders the evictable cached blocks. The local policy is an O(1) LRU; a policy
steered by the prefix index service mirrors these calls to it (engine_service/index/policy.py).
"""

from collections import OrderedDict
from typing import Protocol


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
    within a chain the leaves reach the eviction end before their parents (leaf-first)."""

    def __init__(self) -> None:
        self._evictable: OrderedDict[bytes, None] = OrderedDict()

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def on_commit(self, block_hash: bytes, parent_hash: bytes | None, block_id: int) -> None:
        pass

    def on_acquire(self, block_hash: bytes, was_evictable: bool) -> None:
        if was_evictable:
            del self._evictable[block_hash]

    def on_release(self, block_hash: bytes, now_evictable: bool) -> None:
        if now_evictable:
            self._evictable[block_hash] = None

    def pick_victims(self, num_blocks: int) -> list[bytes]:
        victims = []
        while self._evictable and len(victims) < num_blocks:
            victims.append(self._evictable.popitem(last=False)[0])
        return victims

    @property
    def num_pinned_idle(self) -> int:
        return 0

    def release_pins(self, num_blocks: int) -> int:
        return 0

    def evictable_hashes(self) -> list[bytes]:
        return list(self._evictable)

    def on_prefix_query(self, chain: list[bytes], num_hit_blocks: int) -> None:
        pass

    def begin_step(self) -> None:
        pass

    def end_step(self) -> None:
        pass
