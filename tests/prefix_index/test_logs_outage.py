"""What the index logs while Redis is down and while a misconfigured caller retries: the
outage once (its health logger), not once per refused call; a refused caller once per
interval, not every call. Each call refused with UNAVAILABLE was a WARNING (about 230 lines a
minute with two engines and a router), and each refused caller's call too (every 0.5 s for
one engine with a router's certificate). In-process index on real Redis, real TLS."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from prefix_index.api.client import PrefixIndexClientError
from prefix_index.server.config import IndexConfig
from prefix_index.server.main import IndexServer
from prefix_index.server.servicer import RefusedCallers
from prefix_index.tools.redis_process import RedisProcess
from trust.identity import ENGINE_ROLE, INDEX_ROLE, ROUTER_ROLE

SERVICER = "prefix_index.server.servicer"
HEALTH = "prefix_index.server.health"


def lines(caplog, logger: str, level: int, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == logger and r.levelno == level and text in r.getMessage()]


async def refused(call, code: str) -> None:
    with pytest.raises(PrefixIndexClientError) as error:
        await call
    assert error.value.code.name == code


def test_calls_refused_while_redis_is_down_are_logged_once(test_certs, caplog):
    redis = RedisProcess().start()

    async def body() -> None:
        server = IndexServer(IndexConfig(redis_url=redis.url), tls=test_certs.material(INDEX_ROLE))
        port = await server.start()
        target = f"127.0.0.1:{port}"
        try:
            redis.kill()
            deadline = time.monotonic() + 20
            while server.health.redis_up is not False:  # its probe notices
                assert time.monotonic() < deadline, "the outage was not noticed"
                await asyncio.sleep(0.05)
            async with test_certs.index_client(target, 5.0, ENGINE_ROLE) as engine, \
                    test_certs.index_client(target, 5.0, ROUTER_ROLE) as router:
                for i in range(12):  # as degraded engines retry registering
                    await refused(engine.register(f"engine-{i}", "m", 16, 8), "UNAVAILABLE")
                for _ in range(5):  # as routers' discovery asks
                    await refused(router.stats(""), "UNAVAILABLE")
                for _ in range(3):  # as routers watch residency again
                    with pytest.raises(PrefixIndexClientError):
                        async for _change in router.watch_residency():
                            pass
        finally:
            await server.stop(0.5)

    try:
        with caplog.at_level(logging.DEBUG):
            asyncio.run(body())
    finally:
        redis.kill()
    assert len(lines(caplog, HEALTH, logging.WARNING, "redis unreachable")) == 1
    assert lines(caplog, SERVICER, logging.WARNING, "redis unavailable") == []
    # Still there for whoever asks for DEBUG: every refused call.
    assert len(lines(caplog, SERVICER, logging.DEBUG, "Register: redis unavailable")) == 12
    assert len(lines(caplog, SERVICER, logging.DEBUG, "Stats: redis unavailable")) == 5
    assert len(lines(caplog, SERVICER, logging.DEBUG, "WatchResidency: redis")) == 3


def test_a_refused_caller_is_logged_once_per_interval_not_per_call(redis_server, test_certs,
                                                                   caplog):
    async def body() -> None:
        server = IndexServer(IndexConfig(redis_url=redis_server.url),
                             tls=test_certs.material(INDEX_ROLE))
        port = await server.start()
        target = f"127.0.0.1:{port}"
        try:
            async with test_certs.index_client(target, 5.0, ROUTER_ROLE) as router, \
                    test_certs.index_client(target, 5.0, ENGINE_ROLE) as engine:
                for _ in range(10):  # an engine deployed with a router's certificate
                    await refused(router.register("engine-x", "m", 16, 8), "PERMISSION_DENIED")
                for _ in range(3):  # another identity refused: its own line
                    await refused(engine.lookup([b"x" * 16]), "PERMISSION_DENIED")
        finally:
            await server.stop(0.5)

    with caplog.at_level(logging.WARNING, logger=SERVICER):
        asyncio.run(body())
    assert len(lines(caplog, SERVICER, logging.WARNING, "Register refused")) == 1
    assert len(lines(caplog, SERVICER, logging.WARNING, "Lookup refused")) == 1


def test_refused_callers_are_counted_between_lines_and_their_number_bounded():
    callers = RefusedCallers(interval_s=3600.0, capacity=2)
    assert callers.should_log("a") == 0
    assert [callers.should_log("a") for _ in range(4)] == [None] * 4
    assert callers.should_log("b") == 0
    callers.interval_s = 0.0  # its interval past: logged, with the refusals not logged
    assert callers.should_log("a") == 4
    callers.interval_s = 3600.0
    assert callers.should_log("c") == 0  # a third: the oldest line's ("b") forgotten
    assert callers.should_log("a") is None and callers.should_log("c") is None
    assert callers.should_log("b") == 0  # logged again as new ("a" forgotten now)
    assert callers.should_log("a") == 0
