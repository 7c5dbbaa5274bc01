"""Prefixes the router has just sent to a replica, which the index cannot show yet.

A request's prompt blocks reach the index only after the replica has prefilled them and
reported the commit, a few hundred milliseconds after routing and more when the replica has a
queue. A second request for the same prefix in that window would see no replica holding it, go
to the least loaded one and prefill (and cache) the prefix there as well, evicting another
prefix for it. So each replica's recent chains count as held for `ttl_s`: long enough for the
prefill and its report, short enough that a prefix the replica evicted soon after is not
credited for long. Chain hashes cover everything before them, so a leading run of known hashes
is a shared prefix.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence


class PendingPrefixes:
    """One replica's recently routed chains. Changed on the router's event loop only."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._expiry: dict[bytes, float] = {}  # block hash -> when its credit ends
        self._routed: deque[tuple[float, Sequence[bytes]]] = deque()  # by expiry

    def add(self, chain: Sequence[bytes], now: float) -> None:
        self._purge(now)  # (also bounds what a replica nobody asks about keeps)
        if not chain:
            return
        expiry = now + self.ttl_s
        for block_hash in chain:
            self._expiry[block_hash] = expiry
        self._routed.append((expiry, chain))

    def matched(self, chain: Sequence[bytes], now: float) -> int:
        """Leading blocks of `chain` routed here within the last `ttl_s`."""
        self._purge(now)
        count = 0
        for block_hash in chain:
            if block_hash not in self._expiry:
                break
            count += 1
        return count

    def forget(self, chain: Sequence[bytes]) -> None:
        """The chain did not reach the replica (it failed or refused the request). Another
        request's credit for the same hashes goes too: less credit, never credit for blocks
        that are not on their way."""
        for block_hash in chain:
            self._expiry.pop(block_hash, None)

    def __len__(self) -> int:
        return len(self._expiry)

    def _purge(self, now: float) -> None:
        while self._routed and self._routed[0][0] <= now:
            expiry, chain = self._routed.popleft()
            for block_hash in chain:
                if self._expiry.get(block_hash) == expiry:  # not routed again since
                    del self._expiry[block_hash]
