"""The HTTP API served by uvicorn on the caller's event loop (the gRPC server's), so the HTTP
handlers call the servicer in-process, on the same loop as its gRPC calls."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import time

import uvicorn
from uvicorn.config import SSL_PROTOCOL_VERSION, create_ssl_context

from openai_api.app import BODY_TIMEOUT_S, create_app
from openai_api.backend import Backend
from openai_api.connection_guard import (
    HEAD_TIMEOUT_S,
    TlsAcceptor,
    default_max_connections,
    guarded_h11,
)
from prefix_index.tools.bind_error import BindError
from tenancy.gate import Gate
from trust.credentials import TlsMaterial

log = logging.getLogger("openai_api.server")
# What uvicorn's stop gives requests whose connections were aborted to unwind (a cancelled
# engine call, a closed generator) before it cancels them itself.
UNWIND_S = 1.0


class _LoopServer(uvicorn.Server):
    """uvicorn without its signal handlers: the process's own (drain on SIGTERM) stay."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class HttpServer:
    """Bound early (a taken port fails before anything else starts, as the gRPC port does),
    served once the backend exists."""

    def __init__(self, host: str, port: int, gate: Gate | None = None,
                 tls: TlsMaterial | None = None, require_client_cert: bool = False,
                 head_timeout_s: float = HEAD_TIMEOUT_S, body_timeout_s: float = BODY_TIMEOUT_S,
                 max_connections: int | None = None, send_stall_timeout_s: float = 0.0,
                 tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None) -> None:
        self.host, self.requested_port = host, port
        self.gate = gate  # who may call (tenancy/gate.py); None: anyone
        self.tls = tls  # HTTPS with the gRPC port's certificate; None: plain HTTP
        # As the gRPC port asks: a client certificate the CA signed, or the handshake fails
        # (an engine behind a router); False: any client (a front door, an engine alone).
        self.require_client_cert = require_client_cert
        if tls is not None and tls.files is None:
            raise ValueError("tls: HTTPS needs the certificate and key as files (uvicorn)")
        # A request's head and body must arrive in time, and the connections are counted
        # (connection_guard.py): a client that opens sockets and sends nothing, or a byte at a
        # time, holds none of the process's file descriptors for long.
        self.head_timeout_s, self.body_timeout_s = head_timeout_s, body_timeout_s
        self.max_connections = max_connections or default_max_connections()
        # A stream whose client takes nothing this long is closed (disconnect.py); 0: never.
        self.send_stall_timeout_s = send_stall_timeout_s
        self.tool_call_parser = tool_call_parser  # tool_choice "auto" (tool_parsers.py)
        self.reasoning_parser = reasoning_parser  # thinking apart (reasoning_parsers.py)
        self.port = 0
        self._socket: socket.socket | None = None
        self._server: _LoopServer | None = None
        self._task: asyncio.Task | None = None
        self._tls_acceptor: TlsAcceptor | None = None

    def bind(self) -> int:
        """BindError when the port is taken; returns the bound port."""
        self._socket = _bind(self.host, self.requested_port)
        self.port = self._socket.getsockname()[1]
        return self.port

    async def start(self, backend: Backend) -> None:
        if self._socket is None:
            self.bind()
        http = guarded_h11(self.head_timeout_s, self.max_connections)
        if self.tls is not None:
            # TLS is set up here, not by uvicorn: its create_server(ssl=...) hands a connection
            # to the protocol only after the handshake, untimed and uncounted until then.
            files = self.tls.files
            mutual = self.require_client_cert
            context = create_ssl_context(
                certfile=str(files.cert), keyfile=str(files.key), password=None,
                ssl_version=SSL_PROTOCOL_VERSION,
                cert_reqs=ssl.CERT_REQUIRED if mutual else ssl.CERT_NONE,
                ca_certs=str(files.ca) if mutual else None, ciphers=None)
            self._tls_acceptor = TlsAcceptor(http, context, self.head_timeout_s,
                                             self.max_connections)
            http = self._tls_acceptor
        config = uvicorn.Config(create_app(backend, self.gate, self.body_timeout_s,
                                           self.send_stall_timeout_s, self.tool_call_parser,
                                           self.reasoning_parser),
                                lifespan="off", http=http,
                                log_level="warning", access_log=False)
        self._server = _LoopServer(config)
        self._task = asyncio.ensure_future(self._server.serve(sockets=[self._socket]))
        while not self._server.started:  # bound already: this is uvicorn's own set-up
            if self._task.done():
                self._task.result()  # its error, if it failed
                raise BindError(f"HTTP port {self.host}:{self.port}: the server did not start")
            await asyncio.sleep(0.01)
        log.info("HTTP API on %s://%s:%d", self.scheme, self.host, self.port)

    @property
    def scheme(self) -> str:
        return "https" if self.tls is not None else "http"

    async def stop(self, grace_s: float = 1.0) -> None:
        """While requests run (up to `grace_s`), keeps accepting, so a new request gets the
        drain's 503 (the caller drained first) rather than a refused connection; then stops
        accepting, gives open connections what is left of `grace_s`, and cancels their tasks,
        which aborts what they still run."""
        if self._task is None:
            if self._socket is not None:
                self._socket.close()
            return
        deadline = time.monotonic() + grace_s
        while ((self._server.server_state.tasks or self._unfinished_connections())
               and time.monotonic() < deadline):
            await asyncio.sleep(0.05)
        if self._tls_acceptor is not None:
            self._tls_acceptor.abort_handshakes()
        unfinished = self._unfinished_connections()
        for connection in unfinished:
            connection.transport.abort()
        if unfinished:
            log.warning("%d HTTP responses still unfinished after the drain (their clients "
                        "take nothing, or they still run): connections closed",
                        len(unfinished))
        self._server.config.timeout_graceful_shutdown = max(
            UNWIND_S if unfinished else 0.1, deadline - time.monotonic())
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    def _unfinished_connections(self) -> list:
        """The connections whose response is not complete, or is but still has bytes this
        process holds for a client that has not taken them. Aborting one ends its request as
        when its client leaves (disconnect.py: its work cancelled, the engine's request
        aborted). uvicorn would instead cancel the request at its own deadline, and wait on a
        connection whose bytes cannot be sent, logging an ERROR for each (with an "Exception
        in ASGI application" traceback for a request), though a client that stopped reading is
        no server error."""
        found = []
        for connection in list(self._server.server_state.connections):
            cycle = getattr(connection, "cycle", None)
            transport = getattr(connection, "transport", None)
            if transport is None or transport.is_closing():
                continue
            if ((cycle is not None and not cycle.response_complete)
                    or transport.get_write_buffer_size() > 0):
                found.append(connection)
        return found


def _bind(host: str, port: int) -> socket.socket:
    bare = host.strip("[]")
    sock = None
    try:
        family = socket.getaddrinfo(bare or None, port, type=socket.SOCK_STREAM,
                                     flags=socket.AI_PASSIVE)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and bare in ("::", ""):
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((bare, port))
        sock.listen(2048)
    except OSError as error:
        if sock is not None:
            sock.close()
        raise BindError(f"HTTP port {host}:{port}: {error.strerror or error}") from error
    sock.setblocking(False)
    return sock
