"""A full Redis (maxmemory with noeviction, as compose runs it): the index still answers every
read — a router's Lookup, Stats and WatchResidency snapshot — and an engine's heartbeat, while
a write (Register, Apply) gets RESOURCE_EXHAUSTED saying Redis is full; once memory frees,
writes pass again.

A real redis-server at a tiny maxmemory, filled by another client; the index on the session's
certificates."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import redis

from prefix_index.api.client import PrefixIndexClientError
from prefix_index.api.ops import Release
from prefix_index.tools.launch import IndexProcess
from prefix_index.tools.redis_process import RedisProcess
from tests.prefix_index.chains import commit_ops, make_chain
from trust.identity import ENGINE_ROLE, ROUTER_ROLE

MAXMEMORY = ["--maxmemory", "4mb", "--maxmemory-policy", "noeviction"]
JUNK_VALUE = b"x" * 4096


def fill(url: str) -> int:
    """Writes junk keys until Redis refuses for its maxmemory; how many it took."""
    client = redis.Redis.from_url(url)
    written = 0
    try:
        while True:
            client.set(f"junk:{written}", JUNK_VALUE)
            written += 1
    except redis.exceptions.OutOfMemoryError:
        return written
    finally:
        client.close()


def drop_junk(url: str, count: int) -> None:
    client = redis.Redis.from_url(url)
    try:
        for start in range(0, count, 500):
            client.delete(*(f"junk:{i}" for i in range(start, min(start + 500, count))))
    finally:
        client.close()


async def expect_full(call) -> str:
    with pytest.raises(PrefixIndexClientError) as refused:
        await call
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
    assert "redis is full" in refused.value.details
    return refused.value.details


def test_reads_answer_and_writes_are_refused_while_redis_is_full(test_certs):
    with RedisProcess(extra_args=MAXMEMORY) as full_redis, \
            IndexProcess(full_redis.url, ["--log-level", "ERROR", "--grace-s", "1"],
                         tls=test_certs.files("index")) as index:
        async def body():
            engine = test_certs.index_client(index.target, 5.0, ENGINE_ROLE)
            router = test_certs.index_client(index.target, 5.0, ROUTER_ROLE)
            chain = make_chain("before-full", 3)
            await engine.register("full-engine", "m", 16, 32, 60, nonce="n")
            await engine.apply(commit_ops(chain, 0) + [Release(chain)])

            junk = fill(full_redis.url)
            assert junk > 0

            # Reads: the routers keep routing by the index.
            [match] = await router.lookup(chain)
            assert (match.engine_id, match.matched_blocks) == ("full-engine", 3)
            [held] = await router.stats("full-engine")
            assert (held.blocks, held.evictable) == (3, 3)
            assert [s.engine_id for s in await router.stats("")] == ["full-engine"]
            resident = set()
            async for change in router.watch_residency():
                if change is None:
                    break  # the snapshot is complete
                resident |= set(change.added)
            assert resident == set(chain)

            # The engine's lease holds: a heartbeat only extends TTLs, which Redis allows.
            assert await engine.heartbeat() > 0

            # Writes: refused with the reason, nothing half done.
            more = make_chain("while-full", 2)
            details = await expect_full(engine.apply(commit_ops(more, 3)))
            assert "maxmemory" in details
            newcomer = test_certs.index_client(index.target, 5.0, ENGINE_ROLE)
            await expect_full(newcomer.register("newcomer", "m", 16, 32, 60, nonce="m"))
            [held] = await router.stats("full-engine")
            assert held.blocks == 3

            # Memory freed: the same write passes, and the index was never harmed.
            drop_junk(full_redis.url, junk)
            [ok, _] = await engine.apply(commit_ops(more, 3))
            assert ok.ok
            [held] = await router.stats("full-engine")
            assert held.blocks == 5
            for client in (engine, router, newcomer):
                await client.close()
        asyncio.run(body())
