"""An Apply the index cancels (its drain's grace ran out: a rolling restart behind one address)
has an unknown outcome, as one whose connection dropped: the link sends it once more with the
same sequence number, which the index applies at most once, and stays linked.

Between the engine and the real index (real Redis, TLS both ways) sits a forwarding proxy that
passes every call through and answers the first Apply's reply with CANCELLED instead, after the
index applied it: the write happened, the engine was told it did not.
"""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from engine_service.index.link import connect_prefix_index
from prefix_index.tools.launch import IndexProcess
from prefix_index.tools.redis_process import RedisProcess
from tests.service.index_fixtures import (
    BLOCK_SIZE,
    DEADLINE_S,
    INDEX_ARGS,
    Driver,
    index_matches_pool,
    link_options,
    make_engine,
    prompt_ids,
    wait_until,
)
from trust.credentials import aio_channel
from trust.identity import ENGINE_ROLE, INDEX_ROLE

pytestmark = pytest.mark.timeout(120)


def _identity(data: bytes) -> bytes:
    return data


class CancellingProxy:
    """A gRPC proxy on its own thread and loop: the index's certificate to the engine, the
    engine's to the index. Cancels the reply of the first Apply it forwards."""

    def __init__(self, certs, upstream: str) -> None:
        self.certs, self.upstream = certs, upstream
        self.cancelled_applies = 0
        self.forwarded_applies = 0
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._loop.run_until_complete,
                                        args=(self._serve(),), daemon=True)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> CancellingProxy:
        self._thread.start()
        assert self._ready.wait(10), "the proxy did not start"
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        channel = aio_channel(self.upstream, self.certs.material(ENGINE_ROLE), INDEX_ROLE)
        proxy = self

        class Forward(grpc.GenericRpcHandler):
            def service(self, details):
                method = details.method
                call = channel.unary_unary(method, request_serializer=_identity,
                                           response_deserializer=_identity)

                async def forward(request: bytes, context) -> bytes:
                    reply = await call(request, timeout=context.time_remaining())
                    if method.endswith("/Apply"):
                        proxy.forwarded_applies += 1
                        if not proxy.cancelled_applies:
                            proxy.cancelled_applies += 1
                            await context.abort(grpc.StatusCode.CANCELLED,
                                                "the server is shutting down")
                    return reply

                return grpc.unary_unary_rpc_method_handler(
                    forward, request_deserializer=_identity, response_serializer=_identity)

        server = grpc.aio.server()
        server.add_generic_rpc_handlers((Forward(),))
        credentials = self.certs.files(INDEX_ROLE).load().server_credentials()
        self.port = server.add_secure_port("127.0.0.1:0", credentials)
        await server.start()
        self._ready.set()
        await self._stop.wait()
        await server.stop(0)
        await channel.close()


def test_an_apply_the_index_cancels_is_sent_again_and_the_link_holds(tiny_llama_dir,
                                                                     test_certs):
    with (RedisProcess() as redis,
          IndexProcess(redis.url, INDEX_ARGS, tls=test_certs.files(INDEX_ROLE)) as index,
          CancellingProxy(test_certs, index.target) as proxy):
            engine = make_engine(tiny_llama_dir)
            link = connect_prefix_index(engine, proxy.target, "engine-cancelled",
                                        link_options(test_certs))
            try:
                wait_until(lambda: not link.degraded, DEADLINE_S, "registration",
                           engine=engine)
                first_epoch = link.epoch
                driver = Driver(engine)
                driver.add({"a": prompt_ids(seed=7, length=4 * BLOCK_SIZE + 3)})
                driver.run_to_completion()
                wait_until(lambda: proxy.forwarded_applies >= 2, DEADLINE_S,
                           "the cancelled Apply sent again", engine=engine)
                wait_until(lambda: index_matches_pool(test_certs, index.target,
                                                      "engine-cancelled", engine),
                           DEADLINE_S, "the index's view of the engine equals its pool")
                stats = link.stats()
                assert proxy.cancelled_applies == 1
                # Not a failure: no degraded spell, no new registration, no re-sync.
                assert not link.degraded and link.epoch == first_epoch
                assert stats.rpc_errors == 0 and stats.registrations == 1
            finally:
                link.close()
