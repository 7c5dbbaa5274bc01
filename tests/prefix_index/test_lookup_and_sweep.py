"""Lookup from the block-hash -> engines view (answers correct over 100 registered engines; the
timing is in bench/prefix_index.py), and the sweeper pruning engines whose lease ran out."""

from __future__ import annotations

import asyncio
import time

import redis

from prefix_index.api.ops import Evict, Forget, Release
from prefix_index.server.keys import ENGINES_KEY, view_key
from prefix_index.server.store import ENGINE_LIST_TTL_S, SCAN_MAX_ENGINES
from prefix_index.tools.launch import IndexProcess
from prefix_index.tools.redis_process import RedisProcess
from tests.prefix_index.chains import commit_ops, make_chain
from tests.prefix_index.conftest import ONE_CERTIFICATE

ENGINES = 100


def test_lookup_over_100_registered_engines(index_server, engine_id, test_certs):
    async def body():
        chain = make_chain(f"routing-{engine_id}", 6)
        async with test_certs.index_client(index_server.target, 10.0) as c:
            ids = [f"{engine_id}-{i:03d}" for i in range(ENGINES)]
            for i, eid in enumerate(ids):
                await c.register(eid, "m" if i % 10 else "other-model", 16, 16, 30)
                # Engine i holds the first i % 7 blocks (0: none of the chain).
                await c.apply(commit_ops(chain[: i % 7], 0) + [Release(chain[: i % 7])])
            expected = sorted(((eid, i % 7) for i, eid in enumerate(ids) if i % 7),
                              key=lambda m: (-m[1], m[0]))
            got = [(m.engine_id, m.matched_blocks) for m in await c.lookup(chain)]
            assert got == expected
            filtered = [m.engine_id for m in await c.lookup(chain, model_identity="m")]
            assert filtered == [eid for eid, _ in expected if int(eid[-3:]) % 10]
            [m] = [m for m in await c.lookup(chain) if m.engine_id == ids[13]]
            assert (m.num_blocks, m.held_blocks, m.evictable_blocks) == (16, 6, 6)

            # The view follows evictions and forgets, and an engine that registered again
            # (new epoch, nothing held) drops out at once.
            c.attach(ids[6], (await c.stats(ids[6]))[0].epoch)
            [ev] = await c.apply([Evict(2)])
            assert [e.hash for e in ev.evicted] == chain[5:3:-1]
            await c.apply([Forget(chain[3], 3)])
            await c.register(ids[13], "m", 16, 16, 30)
            matches = {m.engine_id: m.matched_blocks for m in await c.lookup(chain)}
            assert matches[ids[6]] == 3 and ids[13] not in matches
            assert matches[ids[20]] == 6
    asyncio.run(body())


def test_lookup_is_exact_when_the_view_lost_a_write(redis_server, index_server, engine_id,
                                                    test_certs):
    """The view is written after each Apply, outside its script. A lost removal must not make
    Lookup claim blocks the engine no longer holds: each candidate is checked."""
    async def body():
        chain = make_chain(f"lost-{engine_id}", 3)
        async with test_certs.index_client(index_server.target, 5.0) as c:
            await c.register(engine_id, "m", 16, 8, 30)
            await c.apply(commit_ops(chain, 0) + [Release(chain)])
            member = f"{engine_id}@{c.epoch}".encode()
            with redis.Redis.from_url(redis_server.url) as raw:
                snapshot = [raw.smembers(view_key(h)) for h in chain]
                await c.apply([Evict(2)])
                for h, members in zip(chain, snapshot, strict=True):  # removals "lost"
                    raw.sadd(view_key(h), *members)
                assert all(member in raw.smembers(view_key(h)) for h in chain)
            [m] = [m for m in await c.lookup(chain) if m.engine_id == engine_id]
            assert m.matched_blocks == 1
    asyncio.run(body())


def test_the_sweeper_prunes_engines_whose_lease_ran_out(redis_server, engine_id, test_certs):
    args = ["--sweep-interval-s", "0.1", "--log-level", "WARNING"]

    async def body(target):
        async with test_certs.index_client(target, 5.0) as c:
            await c.register(engine_id + "-dead", "m", 16, 8, 0.3)
            await c.register(engine_id + "-alive", "m", 16, 8, 30)
            with redis.Redis.from_url(redis_server.url) as raw:
                assert {engine_id + "-dead", engine_id + "-alive"} <= {
                    m.decode() for m in raw.smembers(ENGINES_KEY)}
                # No Lookup or Stats call: the sweeper alone notices the lease ran out.
                deadline = time.monotonic() + 5
                while (raw.sismember(ENGINES_KEY, engine_id + "-dead")
                       and time.monotonic() < deadline):
                    await asyncio.sleep(0.1)
                members = {m.decode() for m in raw.smembers(ENGINES_KEY)}
            assert engine_id + "-dead" not in members
            assert engine_id + "-alive" in members

    with IndexProcess(redis_server.url, [*args, *ONE_CERTIFICATE],
                      tls=test_certs.files("index")) as index:
        asyncio.run(body(index.target))


def test_lookup_gives_the_same_answer_below_and_above_the_scan_limit(engine_id, test_certs):
    """A small fleet is asked engine by engine, a large one through the view: the same
    matches, model filter and order either way. (Its own Redis: the count of registered
    engines decides the path.)"""
    async def body(target):
        chain = make_chain(f"scan-{engine_id}", 5)
        async with test_certs.index_client(target, 5.0) as c:
            small = [f"{engine_id}-s{i}" for i in range(SCAN_MAX_ENGINES - 1)]
            for i, eid in enumerate(small):
                await c.register(eid, "m" if i % 3 else "other-model", 16, 16, 30)
                await c.apply(commit_ops(chain[: i % 6], 0) + [Release(chain[: i % 6])])
            expected = sorted(((eid, i % 6) for i, eid in enumerate(small) if i % 6),
                              key=lambda m: (-m[1], m[0]))
            filtered = [eid for eid, _ in expected if int(eid.rsplit("s", 1)[1]) % 3]
            answers = []
            for phase in range(2):
                assert len(await c.stats("")) == len(small) + phase * SCAN_MAX_ENGINES
                got = [(m.engine_id, m.matched_blocks) for m in await c.lookup(chain)]
                only_m = [m.engine_id for m in await c.lookup(chain, model_identity="m")]
                answers.append((got, only_m))
                # Past the limit: engines that hold nothing of the chain.
                for i in range(SCAN_MAX_ENGINES):
                    await c.register(f"{engine_id}-x{i}", "m", 16, 16, 30)
            assert answers[0] == answers[1] == (expected, filtered)

    with RedisProcess() as own_redis, IndexProcess(own_redis.url,
                                                   ["--log-level", "WARNING"],
                                                   tls=test_certs.files("index")) as index:
        asyncio.run(body(index.target))


def test_lookup_sees_an_engine_registered_through_another_index_process(engine_id, test_certs):
    """Lookup keeps the engine directory for ENGINE_LIST_TTL_S: an engine that registered
    through another index process on the same Redis is found once that much has passed, and
    one that registered through this process at once."""
    async def body(first: str, second: str):
        chain = make_chain(f"directory-{engine_id}", 3)
        async with test_certs.index_client(first, 5.0) as a, \
                test_certs.index_client(second, 5.0) as b:
            await a.register(f"{engine_id}-a", "m", 16, 16, 30)
            await a.apply(commit_ops(chain, 0) + [Release(chain)])
            assert [m.engine_id for m in await a.lookup(chain)] == [f"{engine_id}-a"]
            await b.register(f"{engine_id}-b", "m", 16, 16, 30)
            await b.apply(commit_ops(chain, 0) + [Release(chain)])
            deadline = time.monotonic() + ENGINE_LIST_TTL_S + 5.0
            while len(await a.lookup(chain)) < 2:
                assert time.monotonic() < deadline, "the first index never saw the engine"
                await asyncio.sleep(0.05)
            # Registered through the first process: no wait at all.
            await a.register(f"{engine_id}-c", "m", 16, 16, 30)
            await a.apply(commit_ops(chain[:1], 0) + [Release(chain[:1])])
            matches = {m.engine_id: m.matched_blocks for m in await a.lookup(chain)}
            assert matches == {f"{engine_id}-a": 3, f"{engine_id}-b": 3, f"{engine_id}-c": 1}

    with RedisProcess() as own_redis, \
            IndexProcess(own_redis.url, ["--log-level", "WARNING"],
                         tls=test_certs.files("index")) as first, \
            IndexProcess(own_redis.url, ["--log-level", "WARNING"],
                         tls=test_certs.files("index")) as second:
        asyncio.run(body(first.target, second.target))


def test_a_directory_read_that_raced_a_register_is_not_kept():
    """A Lookup whose directory read was answered before a Register through the same process
    must not keep that older list for a second: the next Lookup reads it again."""
    import redis.asyncio as aredis

    from prefix_index.server.config import PinPolicy
    from prefix_index.server.store import IndexStore

    async def body(url: str):
        client = aredis.Redis.from_url(url)
        store = IndexStore(client, PinPolicy())
        await store.register("race-old", "m", 16, 64, 30)
        read_done = asyncio.Event()
        release = asyncio.Event()
        real = store.engine_ids

        async def held_read():
            ids = await real()  # answered now, before the Register below
            read_done.set()
            await release.wait()
            return ids

        store.engine_ids = held_read
        racing = asyncio.create_task(store._lookup_engine_ids())
        await read_done.wait()
        await store.register("race-new", "m", 16, 64, 30)
        release.set()
        assert "race-new" not in await racing  # (that read predates it)
        store.engine_ids = real
        assert "race-new" in await store._lookup_engine_ids()
        await client.aclose()

    with RedisProcess() as own_redis:  # its own: the directory is all of this Redis's engines
        asyncio.run(body(own_redis.url))
