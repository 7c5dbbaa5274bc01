"""Redis noticed down (a probe timed out) while calls are in flight on other connections: the
index drops its idle connections, and leaves the calls to end by their own timeout or answer.
They failed 'Connection closed by server' at once, which Redis had not done (an operator read
it as Redis refusing clients), even when Redis answered them in time. Real Redis."""

from __future__ import annotations

import asyncio
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
