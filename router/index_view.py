"""The router's view of the prefix index: which replicas exist (their registrations) and which
of them holds the longest prefix of a prompt: from the copy of the index's residency view that
its WatchResidency stream keeps current (router/residency.py), or by a Lookup while that copy
is not synced (the stream is starting, or failed and is being watched again).

While the index cannot be reached the router routes by prefix-hash-bounded and says so (`up`
False, in health and metrics); the discovery loop keeps calling Stats, and its first success
brings the index back, with no action from anyone.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Sequence

import grpc

from prefix_index.api.client import PrefixIndexClient, PrefixIndexClientError
from router.residency import MirrorDivergedError, ResidencyMirror
from trust.credentials import TlsMaterial

log = logging.getLogger("router.index_view")
# Answers that mean the index itself is unreachable or failing (else: this one request was
# refused, e.g. a chain over its limit, and the request is routed without prefix credit).
_DOWN_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                         grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
                         grpc.StatusCode.CANCELLED})
# Between two attempts to watch residency: doubled after each failure, up to the maximum.
WATCH_RETRY_S = 0.2
WATCH_RETRY_MAX_S = 5.0
# A stream that stayed synced this long resets the wait; one failing in its snapshot (or soon
# after it) keeps doubling it, rather than asking for a snapshot every WATCH_RETRY_S.
WATCH_STABLE_S = 10.0


class IndexView:
    def __init__(self, target: str, timeout_s: float, tls: TlsMaterial | None = None) -> None:
        self.target = target
        self.client = PrefixIndexClient(target, timeout_s, tls)
        self.up = False
        self.last_error = "not reached yet"
        self.down_since = time.monotonic()
        self.mirror = ResidencyMirror()
        self.watch_failures = 0  # streams that failed (for tests and health details)

    def _down(self, error: PrefixIndexClientError) -> None:
        if self.up:
            log.warning("prefix index %s unreachable (%s): kv-aware routes by "
                        "prefix-hash-bounded until it is back", self.target, error)
            self.down_since = time.monotonic()
        self.up = False
        self.last_error = str(error)

    def _back(self) -> None:
        if not self.up:
            log.info("prefix index %s reachable: routing by the index again", self.target)
        self.up = True
        self.last_error = ""

    async def engines(self) -> dict[str, str] | None:
        """address -> engine id of every registered engine with a live lease and a serving
        address; None when the index cannot be reached."""
        resets_before = self.mirror.resets
        try:
            stats = await self.client.stats("")
        except PrefixIndexClientError as error:
            self._down(error)
            return None
        self._back()
        self.mirror.forget_except({s.engine_id for s in stats}, resets_before)
        return {s.serving_address: s.engine_id for s in stats
                if s.serving_address and s.lease_remaining_s > 0}

    async def watch(self) -> None:
        """Keeps the residency copy current, for as long as the router runs: watches, and on
        a failure marks the copy unsynced (routes ask by Lookup) and watches again."""
        retry_s = WATCH_RETRY_S
        failing = False  # a watch's end was logged at INFO and none synced since
        while True:
            synced_at = None
            try:
                async for change in self.client.watch_residency():
                    self.mirror.apply(change)
                    if change is None:
                        synced_at = time.monotonic()
                error = "the index ended the stream"
            except (PrefixIndexClientError, MirrorDivergedError) as exc:
                error = str(exc)
            except Exception as exc:  # noqa: BLE001 - whatever it was, the copy is not current
                log.exception("residency watch of %s failed", self.target)
                error = f"{type(exc).__name__}: {exc}"
            self.mirror.lost()
            self.watch_failures += 1
            if synced_at is not None and time.monotonic() - synced_at >= WATCH_STABLE_S:
                retry_s = WATCH_RETRY_S  # it held a while: a new failure starts over
            # Jitter: the routers of one index, cut off together, do not all come back at once
            # for a snapshot.
            wait_s = retry_s * random.uniform(0.5, 1.0)
            # INFO when a watch that held (or the first) ends; its retries failing in turn
            # while the index is down are DEBUG: one line per outage, not one every few s.
            level = logging.INFO if synced_at is not None or not failing else logging.DEBUG
            log.log(level, "residency watch of %s ended (%s): routes ask by Lookup; watching "
                    "again in %.1fs", self.target, error, wait_s)
            failing = True
            await asyncio.sleep(wait_s)
            retry_s = min(2 * retry_s, WATCH_RETRY_MAX_S)

    def held_prefixes_now(self, chain: Sequence[bytes], identity: str) -> dict[str, int] | None:
        """engine id -> leading blocks of `chain` it holds, from the copy, without waiting;
        None when the copy cannot answer (not synced, or the index is down)."""
        if not self.up or not self.mirror.synced:
            return None
        return self.mirror.longest_prefixes(chain, identity)

    async def longest_prefixes(self, chain: Sequence[bytes], identity: str
                               ) -> dict[str, int] | None:
        """engine id -> leading blocks of `chain` it holds (absent: none); None while the index
        is down (then nobody asks it until discovery reaches it again)."""
        if not self.up:
            return None
        if not chain:
            return {}
        try:
            matches = await self.client.lookup(chain, identity)
        except PrefixIndexClientError as error:
            if error.code in _DOWN_CODES:
                self._down(error)
                return None
            log.debug("lookup refused, routing without prefix credit: %s", error)
            return {}
        return {m.engine_id: m.matched_blocks for m in matches}

    async def close(self) -> None:
        await self.client.close()
