"""Which replicas the router's recent requests went to: the share of the traffic each one
serves now.

A replica that takes well over an even share holds what that traffic comes back for (a hot
prefix), and a long prefill started there delays every one of those requests: kv-aware charges
uncached prompt blocks more there (router/policies.py). Counted over the last `window`
decisions, so it means the same at any request rate, but never over fewer than `min_count`
(the first requests after a start say nothing about where traffic goes: one decision is not a
100% share) and only those of the last `max_age_s` seconds (after a quiet spell the replica
that was hot has no queue left to protect).
"""

from __future__ import annotations

from collections import Counter, deque


class RecentRoutes:
    """The replicas of the last routed requests. Changed on the router's event loop only."""

    def __init__(self, window: int, max_age_s: float = 60.0) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1 decisions, got {window}")
        self.window = window
        self.min_count = max(1, window // 4)
        self.max_age_s = max_age_s
        self._routed: deque[tuple[float, str]] = deque()  # (when, replica name), oldest first
        self._counts: Counter[str] = Counter()

    def add(self, replica_name: str, now: float) -> None:
        self._routed.append((now, replica_name))
        self._counts[replica_name] += 1
        self._drop(now)

    def shares(self, now: float) -> dict[str, float]:
        """Replica name -> its share of the recent requests (absent: none); the shares add up
        to less than 1 while fewer than `min_count` requests are recent."""
        self._drop(now)
        total = max(len(self._routed), self.min_count)
        return {name: count / total for name, count in self._counts.items()}

    def _drop(self, now: float) -> None:
        while self._routed and (len(self._routed) > self.window
                                or self._routed[0][0] < now - self.max_age_s):
            _, name = self._routed.popleft()
            self._counts[name] -= 1
            if not self._counts[name]:
                del self._counts[name]

    def __len__(self) -> int:
        return len(self._routed)
