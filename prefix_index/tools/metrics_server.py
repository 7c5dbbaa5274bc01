"""Every service's /metrics endpoint: Prometheus text over HTTP on a port of its own, bounded.

prometheus_client's start_http_server gives each connection a thread of its own and no timeout:
connections that sent nothing held a thread each for as long as they stayed open (300 idle ones,
300 threads in the engine's serving front). Here a connection has `read_timeout_s` from its
accept to be done (request in, response out), and at most `max_connections` are served at once;
one past that is closed at once (a scraper opens one at a time). No line is logged per scrape.

The deadline is one per connection, kept by a single sweeper thread: a socket timeout alone
bounds each read, so a client that sent a header byte every few seconds held its slot for good,
and `max_connections` of them refused every scrape.

A service stopped in-process (tests start and stop many) stops its server too: stop() frees the
port and ends every thread the server started, which would otherwise stay for the process's life.
"""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app

READ_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 16


class _Handler(WSGIRequestHandler):
    timeout = READ_TIMEOUT_S  # StreamRequestHandler: the socket's timeout while it is read

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base's name
        pass  # a scrape every few seconds is no news; a timed-out one neither


class _Deadlines:
    """Shuts a connection's socket down once its deadline passes: its handler's read or write
    then ends at once (EOF or an error), whatever the client trickles."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._due: dict[socket.socket, float] = {}  # at most max_connections: a scan is cheap
        self._stopped = False

    def add(self, sock: socket.socket, deadline: float) -> None:
        with self._changed:
            self._due[sock] = deadline
            self._changed.notify()

    def discard(self, sock: socket.socket) -> None:
        """Before the socket is closed: under the lock, so the sweeper never shuts down a
        descriptor that was closed and reused."""
        with self._changed:
            self._due.pop(sock, None)

    def stop(self) -> None:
        """Ends sweep(), and shuts down every connection still open: their handlers end now,
        not at their deadlines."""
        with self._changed:
            self._stopped = True
            for sock in self._due:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # the client has gone already
            self._due.clear()
            self._changed.notify()

    def sweep(self) -> None:
        with self._changed:
            while not self._stopped:
                now = time.monotonic()
                for sock in [sock for sock, due in self._due.items() if due <= now]:
                    del self._due[sock]
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass  # the client has gone already
                self._changed.wait(min(self._due.values(), default=now + 60.0) - now)


class MetricsServer(socketserver.ThreadingMixIn, WSGIServer):
    # Not daemons: ThreadingMixIn's server_close joins only the threads that are not (its
    # _Threads drops daemons), and stop() promises every connection's thread has ended.
    # Each lasts at most deadline_s (the sweeper shuts its socket then, and at stop), which
    # also bounds what one holds an interpreter's exit.
    daemon_threads = False
    max_connections = MAX_CONNECTIONS
    deadline_s = READ_TIMEOUT_S

    def server_bind(self) -> None:
        self._slots = threading.BoundedSemaphore(self.max_connections)
        self._deadlines = _Deadlines()
        self._sweeper = threading.Thread(target=self._deadlines.sweep, name="metrics-deadlines",
                                         daemon=True)
        self._sweeper.start()
        self._serving: threading.Thread | None = None
        super().server_bind()

    def serve_in_thread(self) -> None:
        self._serving = threading.Thread(target=self.serve_forever, name="metrics", daemon=True)
        self._serving.start()

    def stop(self) -> None:
        """Stops serving (a second call does nothing more): once it returns, the port is free
        and every thread this server started has ended. Blocks up to serve_forever's poll
        interval (0.5 s)."""
        if self._serving is not None:
            self.shutdown()  # (would wait for ever on a serve_forever never started)
            self._serving.join()
        self.server_close()

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # full: closed now, no thread for it
            return
        self._deadlines.add(request, time.monotonic() + self.deadline_s)
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._deadlines.discard(request)
            self._slots.release()
            raise

    def shutdown_request(self, request) -> None:
        self._deadlines.discard(request)
        super().shutdown_request(request)

    def server_close(self) -> None:
        """The port closed, open connections shut down, their threads and the sweeper joined
        (also when the bind failed)."""
        self._deadlines.stop()
        super().server_close()  # ThreadingMixIn joins the connections' (non-daemon) threads
        self._sweeper.join()

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def serve_metrics(registry: CollectorRegistry, port: int, host: str = "0.0.0.0",
                  read_timeout_s: float = READ_TIMEOUT_S,
                  max_connections: int = MAX_CONNECTIONS) -> MetricsServer:
    """Serves `registry` at http://host:port/metrics from a daemon thread; the server (its
    `server_address` says the port bound, its stop() stops it). A connection gets
    `read_timeout_s` in all from its accept, and each of its socket reads as long."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                flags=socket.AI_PASSIVE)[0][0]
    handler = type("Handler", (_Handler,), {"timeout": read_timeout_s})
    server_class = type("Server", (MetricsServer,), {"address_family": family,
                                                     "max_connections": max_connections,
                                                     "deadline_s": read_timeout_s})
    server = server_class((host, port), handler)
    server.set_app(make_wsgi_app(registry))
    server.serve_in_thread()
    return server
