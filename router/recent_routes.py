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

from collections import Counter

from router.recent_window import RecentWindow


class RecentRoutes:
    """The replicas of the last routed requests. Changed on the router's event loop only."""

    def __init__(self, window: int, max_age_s: float = 60.0) -> None:
        self._routed: RecentWindow[str] = RecentWindow(window, max_age_s)  # replica names
        self.min_count = max(1, window // 4)

    def add(self, replica_name: str, now: float) -> None:
        self._routed.add(replica_name, now)

    def shares(self, now: float) -> dict[str, float]:
        """Replica name -> its share of the recent requests (absent: none); the shares add up
        to less than 1 while fewer than `min_count` requests are recent."""
        names = self._routed.items(now)
        total = max(len(names), self.min_count)
        return {name: count / total for name, count in Counter(names).items()}

    def __len__(self) -> int:
        return len(self._routed)
