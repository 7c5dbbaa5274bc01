"""The router's recent decisions: the last `window` of them, none older than `max_age_s`.

Counted in decisions, so a window means the same at any request rate; bounded in age, so a
quiet spell leaves nothing stale behind (recent_routes.py, recent_prefixes.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

Item = TypeVar("Item")


class RecentWindow(Generic[Item]):
    """Items with the time each was added, oldest first. Changed on the router's event loop
    only."""

    def __init__(self, window: int, max_age_s: float) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1 decisions, got {window}")
        self.window = window
        self.max_age_s = max_age_s
        self._added: deque[tuple[float, Item]] = deque()

    def add(self, item: Item, now: float) -> None:
        self._added.append((now, item))
        self._prune(now)

    def items(self, now: float) -> list[Item]:
        """The recent items at `now`, oldest first."""
        self._prune(now)
        return [item for _, item in self._added]

    def drop(self, unwanted: Callable[[Item], bool]) -> None:
        """Forgets the items `unwanted` picks (a replica that restarted)."""
        self._added = deque((when, item) for when, item in self._added if not unwanted(item))

    def _prune(self, now: float) -> None:
        while self._added and (len(self._added) > self.window
                               or self._added[0][0] < now - self.max_age_s):
            self._added.popleft()

    def __len__(self) -> int:
        return len(self._added)
