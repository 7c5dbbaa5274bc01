"""The index's quotas (issue 32): how many engines one identity and everyone together may
register, how fast one engine may send Apply ops, how many residency watchers one identity and
one connection may hold. State lives in this process: with several index processes each counts
its own ops and watchers (engines are counted in Redis, for all of them together)."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from prefix_index.server.config import Quotas
from prefix_index.server.errors import QuotaExceededError

RESYNC_OPS_PER_BLOCK = 2  # a commit, and a pin when pinned (ApplyRate)


@dataclass(slots=True)
class TokenBucket:
    capacity: float
    tokens: float
    refilled_at: float  # time.monotonic()

    def refill(self, rate: float, now: float) -> None:
        self.tokens = min(self.capacity, self.tokens + rate * (now - self.refilled_at))
        self.refilled_at = now


class ApplyRate:
    """Apply ops per second per engine: a token bucket each, refilling at `rate` and holding
    one full re-sync of the engine's pool plus one largest Apply. A re-sync (the engine's
    policy.resync_ops) is a commit per resident block, a pin per pinned one and a few batched
    releases and acquires: at most 2 ops per pool block, with the largest Apply to spare.
    Register fills it, so the re-sync that follows a registration always passes."""

    def __init__(self, rate: float, max_ops: int, max_num_blocks: int,
                 max_engines: int) -> None:
        self.rate = rate
        self.max_ops = max_ops
        # An engine whose pool is not known (not registered): the largest pool's.
        self.default_capacity = float(RESYNC_OPS_PER_BLOCK * max_num_blocks + max_ops)
        self.max_tracked = 2 * max_engines  # engines gone leave no bucket behind for long
        self.buckets: OrderedDict[str, TokenBucket] = OrderedDict()
        self.epochs: dict[str, int] = {}  # the registration each bucket was sized for

    def sized_for(self, engine_id: str, epoch: int) -> bool:
        """Whether engine_id's bucket was sized for the registration of `epoch` (a new one,
        through this process or another, may have another pool)."""
        return engine_id in self.buckets and self.epochs.get(engine_id) == epoch

    def registered(self, engine_id: str, num_blocks: int | None, epoch: int) -> None:
        """A full bucket for the registration of `epoch` (num_blocks None: not known)."""
        capacity = (self.default_capacity if num_blocks is None
                    else float(RESYNC_OPS_PER_BLOCK * num_blocks + self.max_ops))
        self._put(engine_id, TokenBucket(capacity, capacity, time.monotonic()))
        self.epochs[engine_id] = epoch

    def take(self, engine_id: str, num_ops: int) -> None:
        """Spends `num_ops` tokens, or QuotaExceededError (nothing spent)."""
        now = time.monotonic()
        bucket = self.buckets.get(engine_id)
        if bucket is None:
            bucket = TokenBucket(self.default_capacity, self.default_capacity, now)
            self._put(engine_id, bucket)
        bucket.refill(self.rate, now)
        self.buckets.move_to_end(engine_id)
        if num_ops > bucket.tokens:
            wait_s = (num_ops - bucket.tokens) / self.rate
            raise QuotaExceededError(
                f"engine_id {engine_id!r}: {num_ops} ops is past its Apply rate "
                f"(--apply-ops-per-s {self.rate:g}, bursts up to {bucket.capacity:g} ops: one "
                f"re-sync of its pool); {bucket.tokens:.0f} ops left now, enough in "
                f"{wait_s:.2f}s", retry_after_s=wait_s)
        bucket.tokens -= num_ops

    def _put(self, engine_id: str, bucket: TokenBucket) -> None:
        self.buckets[engine_id] = bucket
        self.buckets.move_to_end(engine_id)
        while len(self.buckets) > self.max_tracked:
            gone, _ = self.buckets.popitem(last=False)  # idle longest (gone, most likely)
            self.epochs.pop(gone, None)


def check_engine_count(engine_id: str, live: dict[str, str], principal: str | None,
                       separator: str, quotas: Quotas) -> None:
    """QuotaExceededError when registering `engine_id` adds an engine past a quota. `live`:
    every live engine id -> the nonce it is stored under (principal + separator + nonce on a
    TLS index); re-registering a live id adds nothing."""
    if engine_id in live:
        return
    if len(live) >= quotas.max_engines:
        raise QuotaExceededError(
            f"engine_id {engine_id!r}: {len(live)} engines are registered, the index's quota "
            f"(--max-engines {quotas.max_engines}); one must leave (its lease lapse) first")
    if principal is None:
        return
    prefix = principal + separator
    own = sum(1 for nonce in live.values() if nonce.startswith(prefix))
    if own >= quotas.max_engines_per_identity:
        raise QuotaExceededError(
            f"engine_id {engine_id!r}: this certificate has {own} engines registered, its quota "
            f"(--max-engines-per-identity {quotas.max_engines_per_identity})")


class WatcherSlots:
    """WatchResidency streams held per identity and per connection, under the total."""

    def __init__(self, quotas: Quotas, total: int) -> None:
        self.quotas = quotas
        self.total = total
        self.held = 0
        self.by_identity: dict[str, int] = {}
        self.by_connection: dict[str, int] = {}

    def acquire(self, identity: str | None, connection: str) -> None:
        """Takes a slot, or QuotaExceededError naming the quota that is full."""
        if self.held >= self.total:
            raise QuotaExceededError(f"{self.held} residency watchers already; allowed at most "
                                     f"{self.total} at once per index process")
        per_connection = self.quotas.max_watchers_per_connection
        if self.by_connection.get(connection, 0) >= per_connection:
            raise QuotaExceededError(
                f"this connection holds {per_connection} residency watchers, its quota "
                f"(--max-watchers-per-connection {per_connection})")
        per_identity = self.quotas.max_watchers_per_identity
        if identity is not None and self.by_identity.get(identity, 0) >= per_identity:
            raise QuotaExceededError(
                f"this certificate holds {per_identity} residency watchers, its quota "
                f"(--max-watchers-per-identity {per_identity})")
        self.held += 1
        self.by_connection[connection] = self.by_connection.get(connection, 0) + 1
        if identity is not None:
            self.by_identity[identity] = self.by_identity.get(identity, 0) + 1

    def release(self, identity: str | None, connection: str) -> None:
        self.held -= 1
        _decrement(self.by_connection, connection)
        if identity is not None:
            _decrement(self.by_identity, identity)


def _decrement(counts: dict[str, int], key: str) -> None:
    left = counts[key] - 1
    if left:
        counts[key] = left
    else:
        del counts[key]  # so the maps hold only callers watching now
