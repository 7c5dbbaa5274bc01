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
from collections.abc import AsyncGenerator, Awaitable
from typing import TypeVar

from starlette.types import Receive, Scope, Send

T = TypeVar("T")


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


class EventStream:
    """An ASGI response of server-sent events from `events` (each one `data: ...\\n\\n`), which
    is closed (its `finally` runs) however the response ends. When the server stops with the
    stream still running (its drain's grace ran out), the stream ends with `last_words` (an
    error event and [DONE]) rather than mid-body."""

    def __init__(self, events: AsyncGenerator[bytes, None], last_words: bytes) -> None:
        self.events = events
        self.last_words = last_words

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def pump() -> None:
            nonlocal started
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})
            started = True
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

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
            await self.events.aclose()
