"""The index's Redis clients never retry on their own: a script whose reply was lost must not
run twice behind the Apply sequence check (the engine's retry, with its seq, is the safe one)."""

from __future__ import annotations

import asyncio
from importlib.metadata import version

from redis.asyncio import RedisCluster

from prefix_index.server.main import connect_redis


def test_redis_py_is_a_version_whose_cluster_client_obeys_our_retry():
    major = int(version("redis").split(".")[0])
    assert 6 <= major < 9, version("redis")   # the range pinned in pyproject.toml


def test_clients_are_built_with_no_retries():
    async def body():
        single = connect_redis("redis://127.0.0.1:1/0", 0.5)
        assert single.get_retry().get_retries() == 0
        assert single.connection_pool.connection_kwargs["retry"].get_retries() == 0
        await single.aclose()
        cluster = connect_redis("redis://127.0.0.1:1/0", 0.5, cluster=True)
        assert isinstance(cluster, RedisCluster)
        # What RedisCluster.execute_command reads for its attempts (redis>=6).
        assert cluster.retry.get_retries() == 0
        await cluster.aclose()
    asyncio.run(body())
