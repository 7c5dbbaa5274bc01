"""Redis noticed down (a probe timed out) while calls are in flight on other connections: the
index drops its idle connections, and leaves the calls to end by their own timeout or answer.
They failed 'Connection closed by server' at once, which Redis had not done (an operator read
it as Redis refusing clients), even when Redis answered them in time. Real Redis."""

from __future__ import annotations

import asyncio
import time
import uuid

from grpc_health.v1.health import aio as health_aio

from prefix_index.server.config import PinPolicy
from prefix_index.server.health import RedisHealth
from prefix_index.server.main import connect_redis
from prefix_index.server.metrics import IndexMetrics
from prefix_index.server.store import IndexStore


def test_an_outage_noticed_leaves_calls_in_flight_to_finish(redis_server):
    async def body():
        redis = connect_redis(redis_server.url, 5.0)
        pusher = connect_redis(redis_server.url, 5.0)
        store = IndexStore(redis, PinPolicy())
        health = RedisHealth(store, health_aio.HealthServicer(), [""], IndexMetrics(), 0.2, 5.0)
        await health.set_redis_up(True)
        key = f"outage-{uuid.uuid4().hex}"
        assert await redis.ping()  # an idle pooled connection besides the waiting one
        waiting = asyncio.create_task(redis.blpop([key], timeout=3))
        await asyncio.sleep(0.3)  # it holds its connection now, waiting for Redis's answer
        await health.set_redis_up(False)  # (as the probe does when PING times out)
        await pusher.rpush(key, "answer")
        assert list(await waiting) == [key.encode(), b"answer"]
        # The pool dials anew for the next call.
        assert await redis.ping()
        await store.close()
        await pusher.aclose()

    asyncio.run(body())


def test_calls_that_do_not_reach_redis_do_not_end_the_outage(test_certs):
    """Redis down: a Lookup of an empty chain succeeds without Redis. It made the index take
    Redis for back (health SERVING, 'redis reachable' logged) until the next probe, once per
    such call; now it only brings the next probe forward, which finds Redis still down."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from prefix_index.tools.launch import IndexProcess
    from prefix_index.tools.redis_process import RedisProcess
    from trust.identity import INDEX_ROLE, ROUTER_ROLE

    redis = RedisProcess().start()
    try:
        with IndexProcess(redis.url, ["--log-level", "WARNING", "--probe-interval-s", "0.3"],
                          tls=test_certs.files("index")) as index:
            redis.kill()
            with test_certs.channel(index.target, peer_role=INDEX_ROLE) as channel:
                health = health_pb2_grpc.HealthStub(channel)

                def status() -> int:
                    return health.Check(health_pb2.HealthCheckRequest(), timeout=5).status

                deadline = time.monotonic() + 10
                while status() != health_pb2.HealthCheckResponse.NOT_SERVING:
                    assert time.monotonic() < deadline, "the outage was not noticed"
                    time.sleep(0.05)

                async def lookups() -> list[int]:
                    seen = []
                    async with test_certs.index_client(index.target, 5.0, ROUTER_ROLE) as client:
                        for _ in range(4):
                            assert await client.lookup([]) == []
                            seen.append(status())
                    return seen

                seen = asyncio.run(lookups())
            assert set(seen) == {health_pb2.HealthCheckResponse.NOT_SERVING}, seen
    finally:
        redis.kill()
