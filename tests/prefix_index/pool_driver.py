"""A minimal engine for index tests: a pool of block ids driven only by the index's answers
(admit = acquire, evict what is missing, commit, release) and a mirror of its pin changes."""

from __future__ import annotations

from dataclasses import dataclass, field

from prefix_index.api.client import PrefixIndexClient
from prefix_index.api.ops import Acquire, Commit, Evict, PinState, Release


@dataclass(slots=True)
class PoolDriver:
    client: PrefixIndexClient
    num_blocks: int
    free_ids: list[int] = field(default_factory=list)
    pinned: dict[bytes, PinState] = field(default_factory=dict)  # mirror of the index's pins
    seq: int = 0

    def __post_init__(self) -> None:
        self.free_ids = list(range(self.num_blocks - 1, -1, -1))

    async def _apply(self, ops: list) -> list:
        self.seq += 1
        reply = await self.client.apply_batch(ops, seq=self.seq)
        for change in reply.pin_changes:
            if change.state == PinState.NONE:
                self.pinned.pop(change.hash, None)
            else:
                self.pinned[change.hash] = change.state
        return reply.results

    async def serve(self, chain: list[bytes]) -> int:
        """One request whose prompt is `chain`: returns how many blocks were cache hits."""
        [acq] = await self._apply([Acquire(chain)])
        hits = len(acq.block_ids)
        missing = len(chain) - hits
        if missing > len(self.free_ids):
            [ev] = await self._apply([Evict(missing - len(self.free_ids))])
            self.free_ids.extend(e.block_id for e in ev.evicted)
            if missing > len(self.free_ids):
                raise RuntimeError(f"pool exhausted: {missing} blocks needed, "
                                   f"{len(self.free_ids)} free after eviction")
        commits = []
        for i in range(hits, len(chain)):
            commits.append(Commit(chain[i], chain[i - 1] if i else b"", self.free_ids.pop()))
        results = await self._apply(commits + [Release(chain)])
        if not all(r.ok for r in results):
            raise RuntimeError(f"index refused the request's writes: {results}")
        return hits
