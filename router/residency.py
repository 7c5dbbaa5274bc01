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
    reset_at: int = 0  # the copy's reset count when this registration's reset arrived


class MirrorDivergedError(Exception):
    """A change for an engine the copy does not hold: the copy missed its reset (it dropped the
    engine while it registered again, or a snapshot raced the sweeper), and only a new
    snapshot brings it back."""


class ResidencyMirror:
    def __init__(self) -> None:
        self.engines: dict[str, EngineResidency] = {}
        self.synced = False
        self._snapshot: dict[str, EngineResidency] = {}  # being received (not yet synced)
        self.changes = 0  # applied since the last snapshot (for tests and debugging)
        self.resets = 0  # resets applied, ever: orders them against a directory read

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
                self.resets += 1
                engines[change.engine_id] = EngineResidency(
                    change.epoch, change.model_identity, set(change.added), self.resets)
            return
        if current is None:
            if self.synced:
                raise MirrorDivergedError(
                    f"a residency change for engine {change.engine_id!r}, which this copy "
                    f"does not hold: its reset was missed")
            return  # (in a snapshot: an engine registered after the directory was read)
        if change.epoch != current.epoch:
            return  # an older registration's change: a newer reset came first
        current.hashes.difference_update(change.removed)
        current.hashes.update(change.added)
        self.changes += 1

    def forget_except(self, engine_ids: set[str], resets_before: int) -> None:
        """Drops engines no longer registered (a lease that ran out sends no event).
        `engine_ids`: the directory as read when the copy had applied `resets_before` resets;
        an engine whose reset came after that may have registered after the read, and stays."""
        for engine_id, engine in list(self.engines.items()):
            if engine_id not in engine_ids and engine.reset_at <= resets_before:
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
