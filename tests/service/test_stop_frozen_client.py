"""A server's stop with a client that takes no bytes (frozen, paused, cut off without a reset)
while it streams to it ends within the keepalive timeout: gRPC's stop waits on a connection
with writes pending for the ack of its GOAWAY's ping, for the keepalive timeout at most.
Kubernetes' and compose's kill graces are sized on that bound (STOP_AFTER_DRAIN_S, checked on
the manifests); at gRPC's default of 20 s, an engine stopping after a 30 s drain ran past its
45 s grace and was killed."""

from __future__ import annotations

import asyncio
import time

import grpc

from prefix_index.tools.server_options import ConnectionLimits
from tests.support.frozen_relay import FrozenRelay

KEEPALIVE_TIMEOUT_S = 1.0


async def _flood(request: bytes, context) -> None:
    """Writes until the client's connection is full (a generation stream, as far as the
    transport goes)."""
    while True:
        await context.write(b"x" * 4096)


def test_a_stop_waits_on_a_frozen_client_for_the_keepalive_timeout_at_most():
    async def stop_s() -> float:
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
            await asyncio.sleep(0.5)  # (the server's writes fill the connection)
            started = time.monotonic()
            await server.stop(0.5)
            return time.monotonic() - started

    # (It waited 20 s, gRPC's default keepalive timeout, before.)
    assert asyncio.run(stop_s()) < 0.5 + KEEPALIVE_TIMEOUT_S + 3.0
