"""What a hostile review found in the residency feed, each pinned by a test: a subscription
redis-py re-made under the feed (the index reset its Redis pool) ends the feed instead of
silently missing changes; two index deployments on databases of one Redis server do not hear
each other; a change too large for one gRPC message is split; and the router's copy neither
forgets an engine that registered while a directory read was in flight nor applies changes to
an engine whose reset it missed."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid

import pytest
from redis.asyncio import Redis

import prefix_index.api.client as client_module
from prefix_index.api.client import PrefixIndexClientError
from prefix_index.api.ops import ResidencyChange
from prefix_index.server.config import PinPolicy
from prefix_index.server.residency import (
    HEARTBEAT,
    SNAPSHOT_CHUNK,
    SYNCED,
    SubscriptionLostError,
    _split,
    watch,
)
from prefix_index.server.store import IndexStore
from prefix_index.tools.launch import IndexProcess
from router.residency import MirrorDivergedError, ResidencyMirror
from tests.prefix_index.chains import commit_ops, make_chain
from tests.prefix_index.conftest import ONE_CERTIFICATE


def _store(url: str, db: int) -> IndexStore:
    server = url.rsplit("/", 1)[0] if url.count("/") > 2 else url  # without its database
    return IndexStore(Redis.from_url(f"{server}/{db}"), PinPolicy())


async def _next_change(feed) -> ResidencyChange:
    """The next change, past heartbeats (one is sent after each quiet IDLE_PING_S)."""
    while True:
        change = await asyncio.wait_for(feed.__anext__(), 10.0)
        if change is not HEARTBEAT:
            return change


async def _until_synced(feed) -> list[ResidencyChange]:
    seen = []
    async for change in feed:
        if change is SYNCED:
            return seen
        seen.append(change)
    raise AssertionError("the feed ended before SYNCED")


def test_a_subscription_remade_under_the_feed_ends_it(redis_server):
    """A subscription's connection closed under it (as the index's pool reset did when the
    subscriptions shared that pool) is dialed again by redis-py, which re-subscribes on the next
    read without a word. Whatever was published in between is gone, so the feed must end (the
    watcher re-snapshots)."""
    async def body():
        store = _store(redis_server.url, 0)
        engine = f"engine-{uuid.uuid4().hex[:12]}"
        feed = watch(store)
        try:
            await _until_synced(feed)
            await store.subscriber.connection_pool.disconnect()
            await store.register(engine, "m", 16, 64, 60.0)  # published into the gap, or after
            async def read_on() -> None:
                async for change in feed:
                    assert change is not SYNCED

            with pytest.raises(SubscriptionLostError):  # (not a feed that goes on as if whole)
                await asyncio.wait_for(read_on(), 10.0)
        finally:
            await feed.aclose()
            await store.close()
    asyncio.run(body())


def test_the_health_probes_pool_reset_leaves_the_subscriptions_alone(redis_server):
    """A failed probe resets the RPCs' pool; the watchers' subscriptions live in a pool of
    their own and go on, whole."""
    async def body():
        store = _store(redis_server.url, 0)
        engine = f"engine-{uuid.uuid4().hex[:12]}"
        feed = watch(store)
        try:
            await _until_synced(feed)
            await store.reset_connections()  # what a failed health probe does
            await store.register(engine, "m", 16, 64, 60.0)
            change = await _next_change(feed)
            assert change.engine_id == engine and change.reset
        finally:
            await feed.aclose()
            await store.close()
    asyncio.run(body())


def test_deployments_on_two_databases_of_one_server_do_not_hear_each_other(redis_server):
    async def body():
        here, there = _store(redis_server.url, 0), _store(redis_server.url, 1)
        assert here.residency_channel != there.residency_channel
        engine = f"engine-{uuid.uuid4().hex[:12]}"
        feed = watch(here)
        try:
            await _until_synced(feed)
            await there.register(engine, "m", 16, 64, 60.0)
            chain = make_chain("elsewhere", 4)
            reg = await there.register(engine, "m", 16, 64, 60.0)
            await there.apply(engine, reg.epoch, commit_ops(chain, 0))
            await here.register(engine + "-here", "m", 16, 64, 60.0)
            change = await _next_change(feed)
            # The first thing heard is this database's registration, not the other's.
            assert change.engine_id == engine + "-here" and change.reset
        finally:
            await feed.aclose()
            for store in (here, there):
                await store.close()
    asyncio.run(body())


def test_a_change_over_one_message_is_split_and_applies_the_same():
    hashes = [i.to_bytes(16, "little") for i in range(2 * SNAPSHOT_CHUNK + 5)]
    removed, added = tuple(hashes[:SNAPSHOT_CHUNK + 3]), tuple(hashes[SNAPSHOT_CHUNK + 3:])
    change = ResidencyChange("e", 7, added=added, removed=removed)
    parts = _split(change)
    assert len(parts) == 4 and all(len(p.added) + len(p.removed) <= SNAPSHOT_CHUNK
                                   for p in parts)
    whole, split = ResidencyMirror(), ResidencyMirror()
    for mirror in (whole, split):
        mirror.apply(ResidencyChange("e", 7, reset=True, added=removed))
        mirror.apply(SYNCED)
    whole.apply(change)
    for part in parts:
        split.apply(part)
    assert split.engines["e"].hashes == whole.engines["e"].hashes == set(added)


def test_the_copy_keeps_an_engine_that_registered_during_a_directory_read():
    mirror = ResidencyMirror()
    mirror.apply(ResidencyChange("old", 1, reset=True))
    mirror.apply(ResidencyChange("gone", 1, reset=True))
    mirror.apply(SYNCED)
    resets_before = mirror.resets  # the Stats call starts
    mirror.apply(ResidencyChange("new", 5, reset=True, added=(b"h" * 16,)))  # Register lands
    mirror.forget_except({"old"}, resets_before)  # the directory as read before it
    assert set(mirror.engines) == {"old", "new"}


def test_a_change_for_an_engine_the_copy_does_not_hold_is_divergence():
    mirror = ResidencyMirror()
    mirror.apply(SYNCED)
    with pytest.raises(MirrorDivergedError, match="engine 'ghost'"):
        mirror.apply(ResidencyChange("ghost", 3, added=(b"h" * 16,)))
    # An older registration's change for an engine it holds is not: a newer reset came first.
    mirror.apply(ResidencyChange("e", 9, reset=True))
    mirror.apply(ResidencyChange("e", 8, added=(b"x" * 16,)))
    assert mirror.engines["e"].hashes == set()


def test_a_quiet_stream_stays_up_and_a_silent_index_is_taken_for_gone(redis_server,
                                                                       monkeypatch, test_certs):
    """Heartbeats keep a watch with nothing to report alive; an index that stops answering
    without closing the connection (a frozen process, a vanished host) ends the watch by the
    router's own clock."""
    monkeypatch.setattr(client_module, "WATCH_SILENCE_S", 6.0)
    with IndexProcess(redis_server.url, ["--log-level", "WARNING", *ONE_CERTIFICATE],
                      tls=test_certs.files("index")) as index:
        async def body():
            async with test_certs.index_client(index.target, 5.0) as c:
                feed = c.watch_residency()
                async for change in feed:
                    if change is None:
                        break
                quiet_until = time.monotonic() + 8.0  # longer than the silence allowed

                async def quiet() -> None:
                    async for _change in feed:
                        pass  # changes of other tests' engines, if any

                with pytest.raises(asyncio.TimeoutError):  # heartbeats: no error in 8 s
                    await asyncio.wait_for(quiet(), quiet_until - time.monotonic())
                feed = c.watch_residency()
                async for change in feed:
                    if change is None:
                        break
                os.kill(index.proc.pid, signal.SIGSTOP)
                try:
                    started = time.monotonic()
                    with pytest.raises(PrefixIndexClientError, match="DEADLINE_EXCEEDED"):
                        async for _change in feed:
                            pass
                    assert time.monotonic() - started < 6.0 + 5.0
                finally:
                    os.kill(index.proc.pid, signal.SIGCONT)
        asyncio.run(body())


def test_a_draining_index_ends_its_watches_instead_of_waiting_out_the_grace(redis_server,
                                                                            test_certs):
    """A watch never ends by itself: without this, every shutdown with a router attached took
    the whole grace period."""
    grace_s = 20.0
    with IndexProcess(redis_server.url, ["--log-level", "WARNING", "--grace-s",
                                         str(grace_s), *ONE_CERTIFICATE],
                                         tls=test_certs.files("index")) as index:
        async def body():
            async with test_certs.index_client(index.target, 5.0) as c:
                feed = c.watch_residency()
                async for change in feed:
                    if change is None:
                        break
                started = time.monotonic()
                stopping = asyncio.get_running_loop().run_in_executor(None, index.terminate,
                                                                      grace_s + 10)
                with pytest.raises(PrefixIndexClientError, match="shutting down"):
                    async for _change in feed:
                        pass
                assert await stopping == 0
                assert time.monotonic() - started < grace_s / 2
        asyncio.run(body())
