"""A client that goes away aborts its request: both ways of answering watch the connection.

Starlette's StreamingResponse only notices a disconnect when it next writes (ASGI 2.4), and
leaves its iterator to the garbage collector; a request still prefilling, or a non-streaming
one, would run to its end with nobody reading. Here the connection is watched while the answer
is made, and the work is cancelled (which aborts the request in the engine, or cancels the
router's upstream call) the moment the client leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import socket
import struct
import termios
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TypeVar

from starlette.types import Receive, Scope, Send

T = TypeVar("T")
# Where GuardedH11Protocol puts each request's connection (scope["state"]): a stream whose
# client takes nothing is closed through it (connection_guard.py).
TRANSPORT_STATE_KEY = "pagedgen.transport"


class ClientGone(Exception):
    """The client closed the connection before its answer was complete."""


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """`work`'s result; ClientGone (with `work` cancelled) if the client leaves first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(receive))
    gone = False
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():  # the client left, or this call is cancelled (the server stops)
            gone = True
            task.cancel()
            # Waited for either way: the generators `work` runs must be done running before
            # anyone closes them (aclose on a running one raises).
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    if gone or task.cancelled():
        raise ClientGone()
    return task.result()


# struct tcp_info (linux/tcp.h): tcpi_bytes_acked, a u64 at this offset (Linux 4.1 and later).
TCP_INFO_BYTES_ACKED = 120


def acked_bytes(transport) -> int | None:
    """Bytes of this connection its peer has acknowledged (TCP_INFO's tcpi_bytes_acked), TLS
    records included; None where the kernel does not say (then unsent_bytes stands in). It
    grows exactly when the client takes something: a reader far behind is seen only through
    its window updates, and the data they let through is acked."""
    sock = transport.get_extra_info("socket")
    if sock is None or not hasattr(socket, "TCP_INFO"):
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    except OSError:
        return None  # not TCP (a Unix socket)
    if len(info) < TCP_INFO_BYTES_ACKED + 8:
        return None
    return struct.unpack_from("Q", info, TCP_INFO_BYTES_ACKED)[0]


def unsent_bytes(transport) -> int:
    """Bytes written to `transport` its peer has not acknowledged yet: asyncio's buffer and the
    kernel's send queue (SIOCOUTQ). It shrinks as the client takes bytes only while nothing
    refills it: the stream's next event is written as soon as asyncio's buffer drains, so a
    sample may miss the progress acked_bytes sees."""
    unsent = transport.get_write_buffer_size()
    # Under TLS that is the encrypting layer's buffer alone; the socket's transport below it
    # holds up to its high-water mark of records.
    below = getattr(getattr(transport, "_ssl_protocol", None), "_transport", None)
    if below is not None:
        unsent += below.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            queued = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, struct.pack("i", 0))
            unsent += struct.unpack("i", queued)[0]
    return unsent


def taken_mark(transport) -> int:
    """A number that grows whenever the client takes something (and only then, as far as the
    server can tell)."""
    acked = acked_bytes(transport)
    return acked if acked is not None else -unsent_bytes(transport)


class EventStream:
    """An ASGI response of server-sent events from `events` (each one `data: ...\\n\\n`), which
    is closed (its `finally` runs) however the response ends. When the server stops with the
    stream still running (its drain's grace ran out), the stream ends with `last_words` (an
    error event and [DONE]) rather than mid-body.

    A client that takes nothing for `send_stall_timeout_s` while an event waits to be written
    (uvicorn's send waits while the connection's buffer is past its high-water mark) has its
    connection closed at once (aborted: a close would wait for the unread buffer to drain),
    which ends the stream as its leaving does: the request is stopped. Taking anything is the
    peer acknowledging bytes (`taken_mark`); a reader far behind is seen taking something only
    when its kernel reopens its window, once a segment's worth of window (an MSS: ~1.4 KB over
    Ethernet, 64 KiB over loopback) is free, which takes reading up to about twice that: so
    much it must take a timeout. 0: no bound."""

    def __init__(self, events: AsyncGenerator[bytes, None], last_words: bytes,
                 send_stall_timeout_s: float = 0.0,
                 on_stall: Callable[[float], None] | None = None) -> None:
        self.events = events
        self.last_words = last_words
        self.send_stall_timeout_s = send_stall_timeout_s
        self.on_stall = on_stall  # told the seconds the write waited (a metric, a log line)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False
        sending_since: float | None = None  # while a write waits for the client

        async def write(body: bytes, more_body: bool = True) -> None:
            nonlocal sending_since
            sending_since = time.monotonic()
            await send({"type": "http.response.body", "body": body, "more_body": more_body})
            sending_since = None

        async def pump() -> None:
            nonlocal started
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})
            started = True
            async for event in self.events:
                await write(event)
            await write(b"", more_body=False)

        async def watch_sends(transport, timeout_s: float) -> None:
            taken_at = time.monotonic()  # when the client was last seen taking something
            mark = taken_mark(transport)
            waited = 0.0
            while waited < timeout_s:
                await asyncio.sleep(min(1.0, timeout_s / 4))
                now = time.monotonic()
                was, mark = mark, taken_mark(transport)
                if sending_since is None or mark > was:
                    taken_at = now
                waited = now - max(taken_at, sending_since or now)
            transport.abort()  # uvicorn sees the disconnect: unless_disconnected ends pump
            if self.on_stall is not None:
                self.on_stall(waited)

        transport = scope.get("state", {}).get(TRANSPORT_STATE_KEY)
        watcher = (asyncio.ensure_future(watch_sends(transport, self.send_stall_timeout_s))
                   if self.send_stall_timeout_s > 0 and transport is not None else None)
        try:
            await unless_disconnected(receive, pump())
        except (ClientGone, OSError):
            pass  # nobody to answer
        except asyncio.CancelledError:
            if started:
                with contextlib.suppress(Exception):
                    await send({"type": "http.response.body", "body": self.last_words,
                                "more_body": False})
            raise
        finally:
            if watcher is not None:
                watcher.cancel()
            await self.events.aclose()
