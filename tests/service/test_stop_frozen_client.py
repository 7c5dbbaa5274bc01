"""A server's stop with a client that takes no bytes (frozen, paused, cut off without a reset)
ends within the keepalive timeout: while a write to it is pending, gRPC's stop waits for the
ack of its GOAWAY's ping, for the keepalive timeout at most. Kubernetes' and compose's kill
graces are sized on that bound (STOP_AFTER_DRAIN_S, checked on the manifests). (An engine's
stop was seen held 16 s so, by a stream the send-stall watch had ended while its headers
waited to be written; frozen generation streams did not hold it.)"""

from __future__ import annotations

import asyncio
import time

import grpc

from engine_service.serving.connection_limits import generation_limits
from prefix_index.server.config import Limits
from prefix_index.server.main import connection_limits as index_connection_limits
from prefix_index.tools.server_options import STOP_AFTER_DRAIN_S, ConnectionLimits
from tests.support.frozen_relay import FrozenRelay

KEEPALIVE_TIMEOUT_S = 2.0
GRACE_S = 0.5


async def _flood(request: bytes, context) -> None:
    """Writes until the client's window is spent: a write stays pending."""
    while True:
        await context.write(b"x" * 4096)


def test_every_server_s_keepalive_timeout_is_within_the_stop_the_kill_graces_allow():
    """The limits each server builds (an engine's, a router's, the index's, which once set
    its own): their keepalive timeout leaves the rest of the stop its 5 s in
    STOP_AFTER_DRAIN_S, which the manifests' kill graces are checked against."""
    built = {"engine and router": generation_limits(4096, 256),
             "index": index_connection_limits(Limits())}
    for server, limits in built.items():
        timeout_s = dict(limits.options())["grpc.keepalive_timeout_ms"] / 1000
        assert timeout_s + 5.0 <= STOP_AFTER_DRAIN_S, (server, timeout_s)


def test_a_stop_waits_on_a_frozen_client_for_the_keepalive_timeout_at_most():
    async def stop_after_grace_s() -> float:
        limits = ConnectionLimits(max_receive_bytes=1 << 20, max_send_bytes=1 << 20,
                                  keepalive_timeout_ms=round(KEEPALIVE_TIMEOUT_S * 1000))
        server = grpc.aio.server(options=limits.options())
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "test.Flood", {"Flood": grpc.unary_stream_rpc_method_handler(_flood)})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        relay = FrozenRelay(port)
        async with relay.serving() as relayed, grpc.aio.insecure_channel(relayed) as channel:
            flood = channel.unary_stream("/test.Flood/Flood")(b"")
            await flood.read()
            relay.frozen.set()
            await asyncio.sleep(0.5)  # (the client's window is spent)
            started = time.monotonic()
            await server.stop(GRACE_S)
            return time.monotonic() - started - GRACE_S

    waited = asyncio.run(stop_after_grace_s())
    # It waited on the frozen client, and no longer than the timeout (20 s at gRPC's default).
    assert KEEPALIVE_TIMEOUT_S * 0.5 < waited < KEEPALIVE_TIMEOUT_S + 3.0, waited
