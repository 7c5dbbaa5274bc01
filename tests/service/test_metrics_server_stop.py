"""Each service started and stopped in-process (as tests do, many times in one process) stops
its metrics server with it: its port free again, its threads ended. They were never stopped: a
listening socket and threads stayed per start, and a second start on the same port failed."""

from __future__ import annotations

import asyncio
import socket
import threading
import urllib.request

import pytest

from engine_service.core.config import EngineConfig
from engine_service.core.engine import LLMEngine
from engine_service.serving.server import EngineServer, ServerOptions
from prefix_index.server.config import IndexConfig
from prefix_index.server.main import IndexServer
from prefix_index.tools.redis_process import free_port
from router.config import RouterConfig
from router.core import Router
from router.server import RouterServer

pytestmark = pytest.mark.timeout(300)


def make_index(port: int, redis) -> IndexServer:
    return IndexServer(IndexConfig(redis_url=redis.url), port=0, metrics_port=port)


def make_router(port: int, redis) -> RouterServer:
    # A replica nobody serves: the router starts (and is NOT_SERVING) all the same.
    router = Router(RouterConfig(), [f"127.0.0.1:{free_port()}"], None)
    return RouterServer(router, port=0, metrics_port=port)


def make_engine(port: int, redis, model_dir=None) -> EngineServer:
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_blocks=64))
    return EngineServer(engine, ServerOptions(port=0, metrics_port=port))


SERVICES = {"index": make_index, "router": make_router, "engine": make_engine}


def can_listen(port: int) -> bool:
    """Whether a server could listen on `port` now (SO_REUSEADDR, as the metrics server binds:
    its closed connections' TIME_WAIT does not count, a socket still listening does)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen()
        except OSError:
            return False
    return True


def metrics_threads(before: set[threading.Thread]) -> list[str]:
    """Metrics servers' threads (accept loops, deadline sweepers, connections') started since
    `before`: servers other tests of this worker left running have theirs too."""
    return [t.name for t in threading.enumerate()
            if t not in before
            and (t.name.startswith("metrics") or "process_request_thread" in t.name)]


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_a_service_stopped_in_process_frees_its_metrics_port_and_threads(service, redis,
                                                                       tiny_llama_dir):
    port = free_port()
    make = SERVICES[service]
    extra = {"model_dir": tiny_llama_dir} if service == "engine" else {}

    async def start_scrape_stop() -> None:
        server = make(port, redis, **extra)
        await server.start()
        try:
            page = await asyncio.to_thread(
                lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                               timeout=10).read())
            assert page
            # A client that connected and sent nothing: its thread must end with the server.
            idle = socket.create_connection(("127.0.0.1", port))
            await asyncio.sleep(0.1)  # (taken by a thread of the server)
        finally:
            await server.stop(0.5)
        idle.close()

    before = set(threading.enumerate())
    for _ in range(2):  # the same port twice: free again after each stop
        asyncio.run(start_scrape_stop())
        assert can_listen(port), f"metrics port {port} still taken after stop"
        assert metrics_threads(before) == []
