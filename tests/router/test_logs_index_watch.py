"""The router's log while its index is down: its residency watch ending is an INFO line when
a watch that synced ends (or the first one fails), its retries failing in turn DEBUG. It was an
INFO line every 2.5 to 5 s for as long as the index was down. A real index (in-process, real
Redis, mutual TLS) stopped and started under the router's IndexView."""

from __future__ import annotations

import asyncio
import logging
import time

from prefix_index.server.config import IndexConfig
from prefix_index.server.main import IndexServer
from prefix_index.tools.redis_process import RedisProcess, free_port
from router.index_view import IndexView
from trust.identity import INDEX_ROLE, ROUTER_ROLE

LOGGER = "router.index_view"
SETTLE_S = 30.0


async def eventually(condition, what: str) -> None:
    deadline = time.monotonic() + SETTLE_S
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {SETTLE_S}s"
        await asyncio.sleep(0.02)


def watch_lines(caplog, level: int) -> int:
    return sum(1 for r in caplog.records if r.name == LOGGER and r.levelno == level
               and "residency watch" in r.getMessage())


def test_a_watch_failing_again_and_again_logs_once_per_outage(test_certs, caplog):
    redis = RedisProcess().start()
    port = free_port()

    async def index() -> IndexServer:
        server = IndexServer(IndexConfig(redis_url=redis.url), port=port,
                             tls=test_certs.material(INDEX_ROLE))
        await server.start()
        return server

    async def body() -> None:
        server = await index()
        view = IndexView(f"127.0.0.1:{port}", 2.0, test_certs.material(ROUTER_ROLE))
        watching = asyncio.ensure_future(view.watch())
        try:
            for outage in (1, 2):
                await eventually(lambda: view.mirror.synced, "the watch synced")
                failures = view.watch_failures
                await server.stop(0)
                # The first end, then three retries failing while the index is down.
                await eventually(lambda f=failures: view.watch_failures >= f + 4,
                                 "the watch failing again")
                assert watch_lines(caplog, logging.INFO) == outage
                assert watch_lines(caplog, logging.DEBUG) >= 3 * outage
                server = await index()
        finally:
            watching.cancel()
            await asyncio.gather(watching, return_exceptions=True)
            await view.close()
            await server.stop(0)

    try:
        with caplog.at_level(logging.DEBUG, logger=LOGGER):
            asyncio.run(body())
    finally:
        redis.kill()
