"""Which prefixes the router sent to each replica lately: the part of its pool they need.

A replica's pool keeps the prefixes its traffic comes back for only while they fit. A new
prefix placed on a replica whose recent prefixes already fill its pool evicts one of them,
and that one is prefilled again when its traffic returns; placed where there is room, it
evicts only what nobody asked for lately. kv-aware charges for those evictions
(router/policies.py). Counted over the last `window` decisions of the last `max_age_s`
seconds, each prefix once per replica at the most blocks a request of it had.
"""

from __future__ import annotations

from router.recent_window import RecentWindow


class RecentPrefixes:
    """(replica, prefix key, prompt blocks) of the last routed requests. Changed on the
    router's event loop only."""

    def __init__(self, window: int, max_age_s: float = 60.0) -> None:
        self._routed: RecentWindow[tuple[str, bytes, int]] = RecentWindow(window, max_age_s)

    def add(self, replica_name: str, key: bytes, blocks: int, now: float) -> None:
        self._routed.add((replica_name, key, blocks), now)

    def forget(self, replica_name: str) -> None:
        """A new process answers as the replica (its pool empty): none of its prefixes is held."""
        self._routed.drop(lambda routed: routed[0] == replica_name)

    def blocks_of_others(self, key: bytes | None, now: float) -> dict[str, int]:
        """Replica name -> blocks of the recent prefixes other than `key` sent there."""
        largest: dict[tuple[str, bytes], int] = {}
        for name, other, blocks in self._routed.items(now):
            if other != key:
                largest[name, other] = max(blocks, largest.get((name, other), 0))
        held: dict[str, int] = {}
        for (name, _), blocks in largest.items():
            held[name] = held.get(name, 0) + blocks
        return held

    def __len__(self) -> int:
        return len(self._routed)
