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
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    if not task.done() or task.cancelled():
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        raise ClientGone()
    return task.result()


class EventStream:
    """An ASGI response of server-sent events from `events` (each one `data: ...\\n\\n`), which
    is closed (its `finally` runs) however the response ends."""

    def __init__(self, events: AsyncGenerator[bytes, None]) -> None:
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def pump() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await unless_disconnected(receive, pump())
        except (ClientGone, OSError):
            pass  # nobody to answer
        finally:
            await self.events.aclose()
