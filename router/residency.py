"""The router's copy of the index's residency view (WatchResidency): which block hashes each
engine holds, kept current by the changes the index pushes, so a route needs no round trip to
the index (a Lookup costs ~1 ms idle, several behind busy engines; this, microseconds).

Changed only on the router's event loop, by the watch task (router/index_view.py); `synced`
is False until a snapshot is complete and again from the moment the stream fails, and route()
asks the index by Lookup meanwhile.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from prefix_index.api.ops import ResidencyChange


@dataclass(slots=True)
class EngineResidency:
    epoch: int
    model_identity: str
    hashes: set[bytes] = field(default_factory=set)


class ResidencyMirror:
    def __init__(self) -> None:
        self.engines: dict[str, EngineResidency] = {}
        self.synced = False
        self._snapshot: dict[str, EngineResidency] = {}  # being received (not yet synced)
        self.changes = 0  # applied since the last snapshot (for tests and debugging)

    def lost(self) -> None:
        """The stream failed: changes may have been missed until a new snapshot."""
        self.synced = False
        self._snapshot = {}

    def apply(self, change: ResidencyChange | None) -> None:
        """One event of the stream, in order; None ends the snapshot."""
        if change is None:
            self.engines, self._snapshot = self._snapshot, {}
            self.synced = True
            self.changes = 0
            return
        engines = self.engines if self.synced else self._snapshot
        current = engines.get(change.engine_id)
        if change.reset:
            if current is None or change.epoch >= current.epoch:
                engines[change.engine_id] = EngineResidency(
                    change.epoch, change.model_identity, set(change.added))
            return
        if current is None or change.epoch != current.epoch:
            # An older registration's change (a newer reset came first), or one whose reset
            # this copy never saw (impossible while the stream holds): nothing to apply to.
            return
        current.hashes.difference_update(change.removed)
        current.hashes.update(change.added)
        self.changes += 1

    def forget_except(self, engine_ids: set[str]) -> None:
        """Drops engines no longer registered (a lease that ran out sends no event)."""
        for engine_id in [e for e in self.engines if e not in engine_ids]:
            del self.engines[engine_id]

    def longest_prefixes(self, chain: Sequence[bytes], model_identity: str = ""
                         ) -> dict[str, int]:
        """engine id -> leading blocks of `chain` it holds (absent: none), as Lookup answers."""
        matches: dict[str, int] = {}
        if not chain:
            return matches
        first = chain[0]
        for engine_id, engine in self.engines.items():
            if first not in engine.hashes or (
                    model_identity and engine.model_identity != model_identity):
                continue
            held = engine.hashes
            matched = 1
            for h in chain[1:]:
                if h not in held:
                    break
                matched += 1
            matches[engine_id] = matched
        return matches
