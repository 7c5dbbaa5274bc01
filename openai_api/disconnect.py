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


def unsent_bytes(transport) -> int:
    """Bytes written to `transport` its peer has not acknowledged yet: asyncio's buffer and the
    kernel's send queue (SIOCOUTQ). The kernel's part matters: with its send buffer grown to
    megabytes, the socket turns writable again (and asyncio's buffer shrinks) only once a
    third of it has drained, a long while at a slow reader's pace."""
    unsent = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            queued = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, struct.pack("i", 0))
            unsent += struct.unpack("i", queued)[0]
    return unsent


class EventStream:
    """An ASGI response of server-sent events from `events` (each one `data: ...\\n\\n`), which
    is closed (its `finally` runs) however the response ends. When the server stops with the
    stream still running (its drain's grace ran out), the stream ends with `last_words` (an
    error event and [DONE]) rather than mid-body.

    A client that takes nothing for `send_stall_timeout_s` while an event waits to be written
    (uvicorn's send waits while the connection's buffer is past its high-water mark) has its
    connection closed at once (aborted: a close would wait for the unread buffer to drain),
    which ends the stream as its leaving does: the request is stopped. Taking anything is what
    waits for the client shrinking (`unsent_bytes`), so a slow reader, whose reads drain it a
    little at a time, is never cut. 0: no bound."""

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
            buffered = 0
            waited = 0.0
            while waited < timeout_s:
                await asyncio.sleep(min(1.0, timeout_s / 4))
                now = time.monotonic()
                was, buffered = buffered, unsent_bytes(transport)
                if sending_since is None or buffered < was:
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
