"""A TCP relay between a client and a server that can stop passing the server's bytes: the
client as the server sees it when it takes nothing at all (a frozen process, a paused VM, a
network that drops everything), not merely a reader that leaves its flow-control window full.
Bytes from the client still go through, unless held: a slow link for the client's next bytes
(a call's header read late)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import grpc


class FrozenRelay:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.frozen = asyncio.Event()  # set: the server's bytes stay where they are
        self.held = asyncio.Event()  # set: the client's bytes wait in the relay
        self._tasks: set[asyncio.Task] = set()

    async def _pipe_to_server(self, reader: asyncio.StreamReader,
                              writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1 << 16):
            while self.held.is_set():
                await asyncio.sleep(0.01)
            writer.write(data)
            await writer.drain()

    async def _pipe_to_client(self, reader: asyncio.StreamReader,
                              writer: asyncio.StreamWriter) -> None:
        while True:
            while self.frozen.is_set():  # (not read: the server's sends fill its socket)
                await asyncio.sleep(0.05)
            data = await reader.read(1 << 16)
            if not data:
                return
            writer.write(data)
            await writer.drain()

    async def _relay(self, client_reader: asyncio.StreamReader,
                     client_writer: asyncio.StreamWriter) -> None:
        # A small receive buffer toward the server: it is full after little output.
        upstream = socket.socket()
        upstream.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        upstream.setblocking(False)
        await asyncio.get_running_loop().sock_connect(upstream, ("127.0.0.1", self.target_port))
        server_reader, server_writer = await asyncio.open_connection(sock=upstream)
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            await asyncio.gather(self._pipe_to_server(client_reader, server_writer),
                                 self._pipe_to_client(server_reader, client_writer),
                                 return_exceptions=True)
        finally:
            self._tasks.discard(task)
            server_writer.close()
            client_writer.close()

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[str]:
        """The relay's address while the block runs; its connections are cut after it."""
        server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        try:
            yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        finally:
            server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)


# The relay runs on the test's event loop (with an in-process router), whose lag on a loaded
# host adds to the hold: 0.1 s came to 0.22 s, near the 0.25 s within which a cancel counts as
# the deadline's (serving/status.py), and once past it. Any hold puts the client's timer first.
HEADER_HELD_S = 0.05


async def called_past_its_deadline_header_held(relay: FrozenRelay, stub, warm, late) -> None:
    """`late` called (unary Generate) with a 0.5 s deadline, its header held HEADER_HELD_S on
    the way through `relay` once `warm` has brought the connection up: the client's deadline
    timer ends it before the server's, which started when the header came."""
    await stub.Generate(warm, timeout=60)
    relay.held.set()
    asyncio.get_running_loop().call_later(HEADER_HELD_S, relay.held.clear)
    try:
        await stub.Generate(late, timeout=0.5)
    except grpc.aio.AioRpcError as error:
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, error
    else:
        raise AssertionError("the call ended before its deadline")
