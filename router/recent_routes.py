"""Which replicas the router's recent requests went to: the share of the traffic each one
serves now.

A replica that takes more than its share holds what that traffic comes back for (a hot
prefix), and a long prefill started there delays every one of those requests: kv-aware charges
uncached prompt blocks more there (router/policies.py). Counted over the last decisions rather
than a time window, so it means the same at any request rate.
"""

from __future__ import annotations

from collections import Counter, deque


class RecentRoutes:
    """The last `window` routed requests' replicas. Changed on the router's event loop only."""

    def __init__(self, window: int) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1 decisions, got {window}")
        self._names: deque[str] = deque(maxlen=window)
        self._counts: Counter[str] = Counter()

    def add(self, replica_name: str) -> None:
        if len(self._names) == self._names.maxlen:
            oldest = self._names[0]
            self._counts[oldest] -= 1
            if not self._counts[oldest]:
                del self._counts[oldest]
        self._names.append(replica_name)
        self._counts[replica_name] += 1

    def shares(self) -> dict[str, float]:
        """Replica name -> its fraction of the recent requests (absent: none)."""
        total = len(self._names)
        return {name: count / total for name, count in self._counts.items()}

    def __len__(self) -> int:
        return len(self._names)
