"""The residency feed WatchResidency serves: every engine's resident block hashes, then each
change as the scripts that make it publish it (apply.lua, register.lua).

It subscribes before it reads the snapshot, so nothing in between is lost: a change published
meanwhile arrives after the snapshot and is replayed over it. That replay is harmless: over a
state that already has them, one engine's changes replayed in order end where they ended (each
hash's last write wins, a reset wipes what came before it, and an older epoch's change is
ignored after a newer reset). It holds only while the subscription delivers every message:
redis-py re-dials a subscription whose connection was closed under it (the index resets its
pool when Redis looks down) and subscribes again without a word, so a second confirmation of
the subscription means changes were missed, and the feed ends for the watcher to take a new
snapshot.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import replace

import msgpack

from prefix_index.api.ops import ResidencyChange
from prefix_index.server.store import IndexStore

# Each watcher holds a Redis connection of its own (its subscription) for as long as it
# watches, from a pool of this many kept apart from the one the RPCs use (IndexStore.subscriber):
# routers are few, so this is a guard against a leak, not a tuning knob.
MAX_WATCHERS = 64
# A snapshot event carries at most this many hashes (16 bytes each): a pool of 100k blocks
# would otherwise be one message over gRPC's 4 MiB default.
SNAPSHOT_CHUNK = 16384
# With nothing published for this long the feed pings Redis on its subscription, and gives up
# (the stream ends UNAVAILABLE, the watcher takes a new snapshot) when no answer came within
# another such interval: a Redis gone silent must not leave a router trusting a frozen copy.
IDLE_PING_S = 2.0


SYNCED = None  # yielded once, between the snapshot and the live changes
# Yielded when Redis answered a ping after IDLE_PING_S without changes: the watcher learns the
# stream is alive (a router cannot otherwise tell a quiet index from a vanished one).
HEARTBEAT = ResidencyChange("", 0)


class RedisSilentError(ConnectionError):
    """Redis did not answer a ping on the subscription in time."""


class SubscriptionLostError(ConnectionError):
    """The subscription was dropped and made again: what was published meanwhile is lost."""


def decode_published(data: bytes) -> ResidencyChange:
    """A published change: msgpack of [kind, engine id, epoch, model, writes], where writes are
    ('+' | '-', hash) pairs in the order the script made them; netted here (the last write of
    each hash wins, so the two lists can be applied in any order)."""
    kind, engine_id, epoch, model, writes = msgpack.unpackb(data, raw=True)
    last: dict[bytes, bool] = {}
    for i in range(0, len(writes), 2):
        last[bytes(writes[i + 1])] = writes[i] == b"+"
    return ResidencyChange(
        engine_id.decode(), int(epoch), reset=kind == b"R", model_identity=model.decode(),
        added=tuple(h for h, held in last.items() if held),
        removed=tuple(h for h, held in last.items() if not held))


async def watch(store: IndexStore) -> AsyncIterator[ResidencyChange | None]:
    """The snapshot (a reset per engine, then its hashes in chunks), SYNCED, then every change
    (and a HEARTBEAT in each quiet interval), until Redis fails (the error propagates) or the
    caller stops iterating."""
    pubsub = store.subscriber.pubsub()
    try:
        await pubsub.subscribe(store.residency_channel)
        await _confirmed(pubsub)
        for engine_id in await store.engine_ids():
            resident = await store.resident(engine_id)
            if resident is None:
                continue  # gone since the directory was read
            epoch, model, hashes = resident
            yield ResidencyChange(engine_id, epoch, reset=True, model_identity=model,
                                  added=tuple(hashes[:SNAPSHOT_CHUNK]))
            for start in range(SNAPSHOT_CHUNK, len(hashes), SNAPSHOT_CHUNK):
                yield ResidencyChange(engine_id, epoch,
                                      added=tuple(hashes[start:start + SNAPSHOT_CHUNK]))
        yield SYNCED
        heard_at = time.monotonic()
        pinged = False
        while True:
            message = await pubsub.get_message(timeout=IDLE_PING_S)
            now = time.monotonic()
            if message is None:
                if pinged and now - heard_at > 2 * IDLE_PING_S:
                    raise RedisSilentError(
                        f"redis did not answer a ping within {IDLE_PING_S:.0f}s")
                if not pinged:
                    await pubsub.ping()
                    pinged = True
                continue
            heard_at, pinged = now, False
            if message["type"] == "pong":
                yield HEARTBEAT
                continue
            if message["type"] == "subscribe":
                raise SubscriptionLostError(
                    "the residency subscription was dropped and made again (the index reset "
                    "its Redis connections): changes published in between are lost")
            if message["type"] == "message":
                for part in _split(decode_published(message["data"])):
                    yield part
    finally:
        await pubsub.aclose()


def _split(change: ResidencyChange) -> list[ResidencyChange]:
    """One change as events of at most SNAPSHOT_CHUNK hashes each (an Evict of a whole large
    pool would be one message over gRPC's limit, failing the stream on every such Apply). The
    added and removed hashes are disjoint, so the parts may be applied one after another."""
    if change.reset or len(change.added) + len(change.removed) <= SNAPSHOT_CHUNK:
        return [change]  # (a published reset carries no hashes)
    parts = [replace(change, added=(), removed=change.removed[start:start + SNAPSHOT_CHUNK])
             for start in range(0, len(change.removed), SNAPSHOT_CHUNK)]
    parts += [replace(change, added=change.added[start:start + SNAPSHOT_CHUNK], removed=())
              for start in range(0, len(change.added), SNAPSHOT_CHUNK)]
    return parts


async def _confirmed(pubsub) -> None:
    """Waits for Redis to confirm the subscription: only then is every later change sure to
    reach us, and only then may the snapshot be read."""
    deadline = time.monotonic() + 2 * IDLE_PING_S
    while time.monotonic() < deadline:
        message = await pubsub.get_message(timeout=IDLE_PING_S)
        if message is not None and message["type"] == "subscribe":
            return
    raise RedisSilentError("redis did not confirm the residency subscription")
