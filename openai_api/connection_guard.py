"""uvicorn's HTTP/1.1 protocol (h11) with the two bounds it leaves out: how long a connection may
take to send a request's head, and how many connections are open at once.

uvicorn closes a connection idle after a response (--timeout-keep-alive), but not one that has
sent no request yet, nor one that sends a head a byte at a time: each held a socket (a file
descriptor of the process that also serves gRPC) for good, and enough of them (slowloris) left
the engine no descriptor to accept a gRPC connection with. Here a connection must deliver a
whole request head within `head_timeout_s` of opening (or of its last response), and one past
`max_connections` is answered 503 and closed at once. The body's own deadline is the app's
(openai_api/app.py `_body`): it is read by the handler, not here.

Over TLS the connection is taken from its TCP accept (`TlsAcceptor`): asyncio's
create_server(ssl=...) calls the HTTP protocol's connection_made only once the handshake is done,
so a client that never sent a ClientHello was neither timed nor counted, and held its descriptor
for asyncio's default handshake timeout (60 s).
"""

from __future__ import annotations

import asyncio
import json
import ssl
from http import HTTPStatus

from uvicorn.protocols.http.h11_impl import H11Protocol

from openai_api.disconnect import TRANSPORT_STATE_KEY
from openai_api.errors import ApiError
from prefix_index.tools.server_options import open_files_share

# What a client gets to send a request's head (the request line and headers): one that means
# to call sends it at once; nginx's client_header_timeout is 60 s, Apache's 20 to 40 s.
HEAD_TIMEOUT_S = 30.0
# Connections the HTTP API keeps at most by default: half the process's open-file limit (the
# other half: gRPC connections, the core's pipes, files), and no more than this.
MAX_CONNECTIONS_CAP = 8192


def default_max_connections() -> int:
    return open_files_share(2, MAX_CONNECTIONS_CAP)


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
        # Each request's scope["state"] is a copy of this: a stream whose client takes nothing
        # aborts the connection with it (disconnect.py EventStream).
        self.app_state = {**self.app_state, TRANSPORT_STATE_KEY: transport}
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
        previous = self.cycle
        super().on_response_complete()
        # A pipelined request whose head came with the last one has started its cycle inside
        # super(): its head is in, so no head is awaited now (the timer would close it running);
        # it re-arms when that request's response completes.
        if not self.transport.is_closing() and self.cycle is previous:
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


class TlsAcceptor:
    """The protocol factory uvicorn.Config(http=...) takes for HTTPS, with uvicorn's `ssl` left
    unset: each TCP connection is counted from its accept against `max_connections` (one past
    it is closed at once: no 503 can go before a handshake), its handshake must finish within
    `handshake_timeout_s`, and only then is it handed to `http_protocol` (GuardedH11Protocol,
    which times its head from there)."""

    def __init__(self, http_protocol: type[H11Protocol], context: ssl.SSLContext,
                 handshake_timeout_s: float, max_connections: int) -> None:
        self.http_protocol, self.context = http_protocol, context
        self.handshake_timeout_s, self.max_connections = handshake_timeout_s, max_connections
        # Accepted, handshake not yet done: each with the task that awaits it (held here: the
        # loop keeps only weak references to tasks).
        self.handshaking: dict[asyncio.Transport, asyncio.Task] = {}

    def __call__(self, **http_arguments) -> asyncio.Protocol:
        """What uvicorn calls once per accepted connection, with the HTTP protocol's arguments."""
        return _TlsHandshake(self, http_arguments)

    def abort_handshakes(self) -> None:
        """On shutdown: a handshake under way is no request to finish."""
        for transport in list(self.handshaking):
            transport.abort()


class _TlsHandshake(asyncio.Protocol):
    """A raw TCP connection until its TLS handshake is done (loop.start_tls)."""

    def __init__(self, acceptor: TlsAcceptor, http_arguments: dict) -> None:
        self.acceptor, self.http_arguments = acceptor, http_arguments

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        acceptor = self.acceptor
        connections = self.http_arguments["server_state"].connections
        if len(connections) + len(acceptor.handshaking) >= acceptor.max_connections:
            transport.abort()
            return
        # Nothing is read until start_tls has set its SSL protocol on the transport.
        transport.pause_reading()
        acceptor.handshaking[transport] = asyncio.ensure_future(self._handshake(transport))

    async def _handshake(self, transport: asyncio.Transport) -> None:
        acceptor = self.acceptor
        early = _UntilHandedOver()
        if transport.is_closing():  # aborted (shutdown) before this ran: no handshake to await
            acceptor.handshaking.pop(transport, None)
            return
        try:
            tls = await asyncio.get_running_loop().start_tls(
                transport, early, acceptor.context, server_side=True,
                ssl_handshake_timeout=acceptor.handshake_timeout_s)
        except OSError:  # timed out, a bad handshake (SSLError) or gone: start_tls closed it
            return
        finally:
            acceptor.handshaking.pop(transport, None)
        if tls is None or early.lost:  # gone as the handshake finished
            return
        http = acceptor.http_protocol(**self.http_arguments)
        tls.set_protocol(http)
        http.connection_made(tls)
        for data in early.data:
            http.data_received(data)
        if early.eof and not http.eof_received():
            tls.close()

    def connection_lost(self, exc: Exception | None) -> None:
        pass  # before start_tls only (it takes the transport over): its failure says so


class _UntilHandedOver(asyncio.Protocol):
    """What the TLS transport delivers to until the HTTP protocol has it: start_tls delivers
    the data read with the handshake's end before it returns, and H11Protocol must see its
    connection_made first. Holds at most what one handshake's last reads brought."""

    def __init__(self) -> None:
        self.data: list[bytes] = []
        self.eof = self.lost = False

    def data_received(self, data: bytes) -> None:
        self.data.append(data)

    def eof_received(self) -> bool:
        self.eof = True
        return True  # kept open: the HTTP protocol, handed the EOF, decides

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
