"""The pins of an engine without the prefix index (LocalLRUPolicy): which cached blocks are
pinned, by which pins, until when. Bookkeeping only; the policy moves blocks between its
evictable and pinned-idle sets from what these methods return.

A pin covers a prefix (its chain of block hashes, root first) and is named by the last hash
of the chain it was asked for, as the tenant ledger names it. Pins overlap: a block stays
pinned while any pin covers it (a count per block), so unpinning or lapsing one prefix leaves
a shorter or longer pinned prefix that shares its blocks whole. Blocks a pin gives up are
returned leaf first, the order the LRU should evict them in.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class _Pin:
    hashes: tuple[bytes, ...]  # root first
    expires_at: float  # on the policy's clock; inf: until unpinned


class PinSet:
    def __init__(self) -> None:
        self._pins: OrderedDict[bytes, _Pin] = OrderedDict()  # least recently pinned first
        self._covers: dict[bytes, int] = {}  # pinned block hash -> pins covering it
        self._next_expiry = math.inf

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._covers

    def __len__(self) -> int:
        """Distinct pinned blocks (what the budget counts)."""
        return len(self._covers)

    def items(self) -> list[tuple[bytes, tuple[bytes, ...], float]]:
        """Every pin as (name, the hashes it covers root first, expiry), least recently
        pinned first (what a re-sync states again)."""
        return [(name, pin.hashes, pin.expires_at) for name, pin in self._pins.items()]

    def oldest(self) -> bytes | None:
        """The name of the least recently pinned pin; None when there is none."""
        return next(iter(self._pins), None)

    def num_new(self, hashes: list[bytes]) -> int:
        """Blocks of `hashes` a pin of them would add to the pinned ones."""
        return sum(h not in self._covers for h in hashes)

    def pin(self, name: bytes, hashes: list[bytes], expires_at: float) -> tuple[list, list]:
        """Pins `hashes` under `name` (a pin of that name again replaces it, keeping the later
        expiry). Returns (blocks newly pinned, blocks no longer pinned)."""
        old = self._pins.pop(name, None)
        if old is not None:
            expires_at = max(expires_at, old.expires_at)
        self._pins[name] = _Pin(tuple(hashes), expires_at)
        added = [h for h in hashes if self._cover(h)]
        dropped = self._uncover(old.hashes) if old is not None else []
        self._next_expiry = min(self._next_expiry, expires_at)
        return added, [h for h in dropped if h not in self._covers]

    def unpin(self, name: bytes) -> list[bytes]:
        """Blocks no longer pinned once the pin `name` is gone (none if there is no such pin)."""
        pin = self._pins.pop(name, None)
        return [] if pin is None else self._uncover(pin.hashes)

    def unpin_oldest(self) -> list[bytes]:
        """Drops the least recently pinned pin; the blocks it leaves unpinned."""
        if not self._pins:
            return []
        return self.unpin(next(iter(self._pins)))

    def expire(self, now: float) -> list[bytes]:
        """Drops every pin whose time has come; the blocks they leave unpinned."""
        if now < self._next_expiry:
            return []
        released = []
        for name in [n for n, p in self._pins.items() if p.expires_at <= now]:
            released += self.unpin(name)
        self._next_expiry = min((p.expires_at for p in self._pins.values()), default=math.inf)
        return released

    def _cover(self, block_hash: bytes) -> bool:
        count = self._covers.get(block_hash, 0)
        self._covers[block_hash] = count + 1
        return count == 0

    def _uncover(self, hashes: tuple[bytes, ...]) -> list[bytes]:
        released = []
        for block_hash in reversed(hashes):  # leaf first
            left = self._covers[block_hash] - 1
            if left:
                self._covers[block_hash] = left
            else:
                del self._covers[block_hash]
                released.append(block_hash)
        return released
