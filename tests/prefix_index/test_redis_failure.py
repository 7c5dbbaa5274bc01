"""Redis killed and restarted mid-test: RPCs fail fast with UNAVAILABLE, health says
NOT_SERVING, and the service recovers by itself with correct answers."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prefix_index.api.client import PrefixIndexClientError
from prefix_index.api.ops import Acquire, Evict, Release
from prefix_index.tools.launch import IndexProcess
from prefix_index.tools.redis_process import RedisProcess
from tests.prefix_index.chains import commit_ops, make_chain
from tests.prefix_index.conftest import INDEX_ARGS
from tests.support.tls import SessionCerts
from trust.identity import INDEX_ROLE, ROUTER_ROLE

SERVICE = "pagedgen.prefix_index.v1.PrefixIndex"


async def _health(certs: SessionCerts, target: str, service: str = "") -> int:
    async with certs.aio_channel(target, ROUTER_ROLE, INDEX_ROLE) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
        return reply.status


async def _wait_health(certs: SessionCerts, target: str, status: int,
                       timeout_s: float = 10.0) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if (await _health(certs, target) == status
                and await _health(certs, target, SERVICE) == status):
            return time.monotonic() - started
        await asyncio.sleep(0.05)
    raise AssertionError(f"health never became {status}")


def test_redis_killed_and_restarted(engine_id, test_certs):
    with RedisProcess() as redis, IndexProcess(
            redis.url, INDEX_ARGS + ["--redis-timeout-s", "0.5", "--probe-interval-s", "0.2"],
            tls=test_certs.files("index")) as index:
        async def body():
            c = test_certs.index_client(index.target, timeout_s=2.0)
            old_epoch = await c.register(engine_id, "m", 16, 16, 30)
            chain = make_chain("survivor", 3)
            await c.apply(commit_ops(chain, 0) + [Release(chain)])

            redis.kill()
            for _ in range(5):              # fail fast, every time, well inside the deadline
                started = time.monotonic()
                with pytest.raises(PrefixIndexClientError) as err:
                    await c.apply([Acquire(chain)])
                assert err.value.code == grpc.StatusCode.UNAVAILABLE
                assert time.monotonic() - started < 1.5
            for call in (c.heartbeat(), c.lookup(chain), c.stats()):
                with pytest.raises(PrefixIndexClientError) as err:
                    await call
                assert err.value.code == grpc.StatusCode.UNAVAILABLE
            await _wait_health(test_certs, index.target,
                               health_pb2.HealthCheckResponse.NOT_SERVING)

            redis.start()                   # same port, empty: Redis lost everything
            await _wait_health(test_certs, index.target, health_pb2.HealthCheckResponse.SERVING)
            # The old epoch holds nothing any more: refused, never told it holds lost blocks.
            with pytest.raises(PrefixIndexClientError) as err:
                await c.apply([Acquire(chain)])
            assert err.value.code == grpc.StatusCode.NOT_FOUND
            new_epoch = await c.register(engine_id, "m", 16, 16, 30)
            assert new_epoch > old_epoch    # epochs rise even though Redis lost its data
            [acq] = await c.apply([Acquire(chain)])
            assert acq.block_ids == []
            # Correct answers again, scripts reloaded after NOSCRIPT.
            await c.apply(commit_ops(chain, 4) + [Release(chain)])
            [acq, rel, ev] = await c.apply([Acquire(chain), Release(chain), Evict(3)])
            assert acq.block_ids == [4, 5, 6]
            assert [e.block_id for e in ev.evicted] == [6, 5, 4]
            await c.apply(commit_ops(chain, 7) + [Release(chain)])
            [match] = await c.lookup(chain)  # its script, too, loaded again
            assert (match.engine_id, match.matched_blocks) == (engine_id, 3)
            stale = test_certs.index_client(index.target, 2.0)
            stale.attach(engine_id, old_epoch)
            with pytest.raises(PrefixIndexClientError) as err:
                await stale.heartbeat()
            assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
            await stale.close()
            await c.close()
        asyncio.run(body())


def test_index_starts_while_redis_is_down_and_serves_once_it_is_up(engine_id, test_certs):
    redis = RedisProcess()                   # port reserved, server not started yet
    index = IndexProcess(redis.url, INDEX_ARGS + ["--probe-interval-s", "0.2"],
                         wait_for_redis=False, tls=test_certs.files("index")).start()
    try:
        async def body():
            await asyncio.sleep(0.5)
            deadline = time.monotonic() + 10
            while True:                      # gRPC up, health NOT_SERVING
                try:
                    assert await _health(test_certs, index.target) == \
                        health_pb2.HealthCheckResponse.NOT_SERVING
                    break
                except grpc.aio.AioRpcError:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.1)
            async with test_certs.index_client(index.target, 2.0) as c:
                with pytest.raises(PrefixIndexClientError) as err:
                    await c.register(engine_id, "m", 16, 8)
                assert err.value.code == grpc.StatusCode.UNAVAILABLE
                redis.start()
                await _wait_health(test_certs, index.target, health_pb2.HealthCheckResponse.SERVING)
                assert await c.register(engine_id, "m", 16, 8) > 0
        asyncio.run(body())
    finally:
        index.terminate()
        redis.stop()


def test_hung_redis_never_holds_an_rpc_past_its_deadline(engine_id, test_certs):
    with RedisProcess() as redis, IndexProcess(
            redis.url, INDEX_ARGS + ["--redis-timeout-s", "0.5", "--probe-interval-s", "0.2"],
            tls=test_certs.files("index")) as index:
        async def body():
            c = test_certs.index_client(index.target, timeout_s=5.0)
            await c.register(engine_id, "m", 16, 16, 30)
            chain = make_chain("hung", 2)
            await c.apply(commit_ops(chain, 0))
            redis.pause()
            try:
                started = time.monotonic()
                with pytest.raises(PrefixIndexClientError) as err:
                    await c.apply([Acquire(chain)])
                assert err.value.code == grpc.StatusCode.UNAVAILABLE
                assert time.monotonic() - started < 2.0     # the Redis timeout, not 5 s
                short = test_certs.index_client(index.target, timeout_s=0.3)
                short.attach(engine_id, c.epoch)
                started = time.monotonic()
                with pytest.raises(PrefixIndexClientError) as err:
                    await short.apply([Acquire(chain)])
                assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
                assert time.monotonic() - started < 1.0
                await short.close()
                await _wait_health(test_certs, index.target,
                                   health_pb2.HealthCheckResponse.NOT_SERVING)
            finally:
                redis.resume()
            await _wait_health(test_certs, index.target, health_pb2.HealthCheckResponse.SERVING)
            # A timed-out call's outcome is unknown (the hung Redis may run it once it wakes;
            # engines re-register and re-sync after such errors), but it is never applied twice
            # and nothing else is lost: refcount = 1 (commit) + 0..2 (timed out) + 1 (now).
            [acq] = await c.apply([Acquire(chain)])
            assert acq.block_ids == [0, 1]
            released = 0
            while (await c.apply([Release(chain)]))[0].ok:
                released += 1
            assert 2 <= released <= 4
            await c.close()
        asyncio.run(body())
