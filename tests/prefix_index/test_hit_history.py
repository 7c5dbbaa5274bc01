"""Hit history that outlives eviction: with the shipped defaults, a hot prefix that LRU drops
between its visits is pinned once its visits reach the hot threshold, and stays cached after.
Only admissions count: forks and re-sync acquires are not uses."""

from __future__ import annotations

import asyncio
import time

from prefix_index.api.ops import Acquire, AcquireKind, Pin, PinState, Release
from prefix_index.server.config import PinPolicy
from prefix_index.tools.launch import IndexProcess
from tests.prefix_index.chains import commit_ops, make_chain
from tests.prefix_index.conftest import ONE_CERTIFICATE
from tests.prefix_index.pool_driver import PoolDriver
from tests.support.tls import SessionCerts

POOL = 96            # pin budget at the default 10%: 9 blocks
HOT_BLOCKS = 8       # a system prompt of 8 blocks
COLD_BLOCKS = 32
COLD_PER_VISIT = 3   # 96 cold blocks between two hot visits: the whole pool


def test_a_returning_prefix_is_pinned_under_the_default_threshold(redis_server, engine_id,
                                                                  test_certs):
    threshold = PinPolicy().hot_threshold
    assert threshold == 8                                   # what ships

    async def body(target: str) -> None:
        async with test_certs.index_client(target, 5.0) as c:
            await c.register(engine_id, "m", 16, POOL, 60, nonce="driver")
            assert c.pin_budget >= HOT_BLOCKS
            engine = PoolDriver(c, POOL)
            hot = make_chain("system-prompt", HOT_BLOCKS)
            hot_hits, cold = [], 0
            for _ in range(threshold + 4):
                hot_hits.append(await engine.serve(hot))
                for _cold in range(COLD_PER_VISIT):
                    await engine.serve(make_chain(f"cold-{cold}", COLD_BLOCKS))
                    cold += 1
            # Until its uses reached the threshold, LRU dropped the whole prefix every time;
            # the visit that reached it pinned the blocks as they were committed again.
            assert hot_hits[:threshold] == [0] * threshold
            assert hot_hits[threshold:] == [HOT_BLOCKS] * 4
            assert engine.pinned == {h: PinState.AUTOMATIC for h in hot}
            s = (await c.stats())[0]
            assert (s.pinned, s.auto_pinned) == (HOT_BLOCKS, HOT_BLOCKS)
            assert s.history <= PinPolicy().history_cap(POOL)

    with IndexProcess(redis_server.url, ["--log-level", "WARNING", *ONE_CERTIFICATE],
                      tls=test_certs.files("index")) as index:
        asyncio.run(body(index.target))


def test_forks_and_resync_acquires_are_not_uses(index_server, engine_id, test_certs):
    async def body():
        async with test_certs.index_client(index_server.target, 5.0) as c:
            await c.register(engine_id, "m", 16, 32, 30)
            chain = make_chain("forked", 3)
            await c.apply(commit_ops(chain, 0) + [Release(chain)])
            for _ in range(10):                             # far past the threshold (3)
                for kind in (AcquireKind.FORK, AcquireKind.RESYNC):
                    [acq, rel] = await c.apply([Acquire(chain, kind), Release(chain)])
                    assert acq.block_ids == [0, 1, 2] and rel.ok
            s = (await c.stats())[0]
            assert (s.pinned, s.queries, s.hits, s.history) == (0, 0, 0, 0)
            # Admissions are: the third one pins the blocks (test threshold 3).
            for _ in range(3):
                reply = await c.apply_batch([Acquire(chain), Release(chain)])
            assert {p.hash: p.state for p in reply.pin_changes} == {
                h: PinState.AUTOMATIC for h in chain}
            s = (await c.stats())[0]
            assert (s.pinned, s.queries, s.hits, s.history) == (3, 9, 9, 3)
    asyncio.run(body())


def test_history_survives_a_reconnect(index_server, engine_id, test_certs):
    """Register (a reconnect's re-sync) drops blocks and pins, not the hit history: the
    re-synced hot blocks are pinned again as they are committed."""
    async def body():
        async with test_certs.index_client(index_server.target, 5.0) as c:
            await c.register(engine_id, "m", 16, 32, 30, nonce="n")
            chain = make_chain("kept", 2)
            await c.apply(commit_ops(chain, 0) + [Release(chain)])
            for _ in range(3):
                await c.apply([Acquire(chain), Release(chain)])
            assert (await c.stats())[0].auto_pinned == 2
            await c.register(engine_id, "m", 16, 32, 30, nonce="n")
            s = (await c.stats())[0]
            assert (s.blocks, s.pinned, s.history) == (0, 0, 2)
            reply = await c.apply_batch(commit_ops(chain, 7))
            assert {(p.hash, p.block_id, p.state) for p in reply.pin_changes} == {
                (chain[0], 7, PinState.AUTOMATIC), (chain[1], 8, PinState.AUTOMATIC)}
    asyncio.run(body())


VISITS = 100


async def _hot_hit_rate(certs: SessionCerts, target: str, engine_id: str,
                        explicit_pin: bool) -> float:
    """One deterministic trace: the hot prefix, then cold prompts that fill the pool, repeated.
    The share of the hot prefix's blocks that were cache hits over all its visits."""
    async with certs.index_client(target, 5.0) as c:
        await c.register(engine_id, "m", 16, POOL, 60, nonce="trace")
        engine = PoolDriver(c, POOL)
        hot = make_chain("system-prompt", HOT_BLOCKS)
        hits = cold = 0
        for visit in range(VISITS):
            hits += await engine.serve(hot)
            if explicit_pin and visit == 0:
                [pin] = await engine._apply([Pin(hot)])  # PinPrefix after the first prefill
                assert pin.ok and pin.count == HOT_BLOCKS
            for _cold in range(COLD_PER_VISIT):
                await engine.serve(make_chain(f"cold-{cold}", COLD_BLOCKS))
                cold += 1
        return hits / (VISITS * HOT_BLOCKS)


def test_pinning_keeps_the_hot_prefix_where_lru_keeps_none(redis_server, engine_id, test_certs):
    """The issue's pinning-under-pressure trace through the index alone (no model): plain LRU
    keeps none of the hot prefix; automatic pinning at the shipped default threshold keeps it
    from its 8th visit on (>= 90% of 100 visits); an explicit pin from the first."""
    with IndexProcess(redis_server.url, ["--hot-threshold", "0", "--log-level", "WARNING",
                                         *ONE_CERTIFICATE],
                      tls=test_certs.files("index")) as lru_only:
        lru = asyncio.run(_hot_hit_rate(test_certs, lru_only.target, engine_id + "-lru", False))
        pinned = asyncio.run(_hot_hit_rate(test_certs, lru_only.target, engine_id + "-pin", True))
    with IndexProcess(redis_server.url, ["--log-level", "WARNING", *ONE_CERTIFICATE],
                      tls=test_certs.files("index")) as defaults:
        auto = asyncio.run(_hot_hit_rate(test_certs, defaults.target, engine_id + "-auto", False))
    assert lru == 0.0
    assert auto == (VISITS - PinPolicy().hot_threshold) / VISITS >= 0.9
    assert pinned == (VISITS - 1) / VISITS


def test_history_decays_and_the_sweeper_drops_what_is_left(redis_server, engine_id, test_certs):
    """Uses fade with the window: two windows without a use and an entry is worth nothing,
    so the sweeper drops it (the cap bounds the history; decay empties it when idle)."""
    args = ["--hot-threshold", "3", "--hot-window-s", "0.3", "--sweep-interval-s", "0.1",
            "--log-level", "WARNING"]

    async def body(target):
        async with test_certs.index_client(target, 5.0) as c:
            await c.register(engine_id, "m", 16, 16, 30)
            await c.apply([Acquire(make_chain("faded", 5))])
            assert (await c.stats())[0].history == 5
            deadline = time.monotonic() + 5
            while (await c.stats())[0].history and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert (await c.stats())[0].history == 0

    with IndexProcess(redis_server.url, [*args, *ONE_CERTIFICATE],
                      tls=test_certs.files("index")) as index:
        asyncio.run(body(index.target))
