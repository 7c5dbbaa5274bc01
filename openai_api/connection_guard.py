"""uvicorn's HTTP/1.1 protocol (h11) with the two bounds it leaves out: how long a connection may
take to send a request's head, and how many connections are open at once.

uvicorn closes a connection idle after a response (--timeout-keep-alive), but not one that has
sent no request yet, nor one that sends a head a byte at a time: each held a socket (a file
descriptor of the process that also serves gRPC) for good, and enough of them (slowloris) left
the engine no descriptor to accept a gRPC connection with. Here a connection must deliver a
whole request head within `head_timeout_s` of opening (or of its last response), and one past
`max_connections` is answered 503 and closed at once. The body's own deadline is the app's
(openai_api/app.py `_body`): it is read by the handler, not here.
"""

from __future__ import annotations

import asyncio
import json
import resource
from http import HTTPStatus

from uvicorn.protocols.http.h11_impl import H11Protocol

from openai_api.errors import ApiError

# What a client gets to send a request's head (the request line and headers): one that means
# to call sends it at once; nginx's client_header_timeout is 60 s, Apache's 20 to 40 s.
HEAD_TIMEOUT_S = 30.0
# Connections the HTTP API keeps at most by default: half the process's open-file limit (the
# other half: gRPC connections, the core's pipes, files), and no more than this.
MAX_CONNECTIONS_CAP = 8192


def default_max_connections() -> int:
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS_CAP
    return max(16, min(MAX_CONNECTIONS_CAP, soft // 2))


def guarded_h11(head_timeout_s: float, max_connections: int) -> type[H11Protocol]:
    """The protocol class uvicorn.Config(http=...) takes, with these bounds."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"head_timeout_s": head_timeout_s, "max_connections": max_connections})


def _raw_response(error: ApiError) -> bytes:
    """A whole response with `Connection: close`, written as bytes: h11 sends a response only
    to a request it has read, and these go where none came."""
    body = json.dumps(error.body(), separators=(",", ":")).encode()
    status = HTTPStatus(error.status)
    return (f"HTTP/1.1 {status.value} {status.phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


class GuardedH11Protocol(H11Protocol):
    head_timeout_s = HEAD_TIMEOUT_S
    max_connections = MAX_CONNECTIONS_CAP

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_timer: asyncio.TimerHandle | None = None
        self._awaited_after = None  # the request cycle the awaited head comes after
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            transport.write(_raw_response(ApiError(
                HTTPStatus.SERVICE_UNAVAILABLE,
                f"open connections to this HTTP API must be at most {self.max_connections}, "
                f"got {len(self.connections)}: retry later, or reuse a connection "
                f"(keep-alive)", code="too_many_connections")))
            transport.close()
            return
        self._await_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)

    def _await_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._awaited_after = self.cycle
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_overdue)

    def _head_overdue(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.cycle is not self._awaited_after:
            return  # a request's head came in time (its body's deadline is the app's)
        partial, _closed = self.conn.trailing_data
        if partial:  # part of a head: say why (a connection that sent nothing just closes)
            self.transport.write(_raw_response(ApiError(
                HTTPStatus.REQUEST_TIMEOUT,
                f"a request's head (request line and headers) must arrive within "
                f"{self.head_timeout_s:g} s, got {len(partial)} bytes of it by then",
                code="request_timeout")))
        self.transport.close()
