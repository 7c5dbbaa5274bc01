"""Every service's /metrics endpoint: Prometheus text over HTTP on a port of its own, bounded.

prometheus_client's start_http_server gives each connection a thread of its own and no timeout:
connections that sent nothing held a thread each for as long as they stayed open (300 idle ones,
300 threads in the engine's serving front). Here a connection has `read_timeout_s` to send its
request, and at most `max_connections` are served at once; one past that is closed at once (a
scraper opens one at a time). No line is logged per scrape.
"""

from __future__ import annotations

import socket
import socketserver
import threading
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app

READ_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 16


class _Handler(WSGIRequestHandler):
    timeout = READ_TIMEOUT_S  # StreamRequestHandler: the socket's timeout while it is read

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base's name
        pass  # a scrape every few seconds is no news; a timed-out one neither


class _BoundedServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True
    max_connections = MAX_CONNECTIONS

    def server_bind(self) -> None:
        self._slots = threading.BoundedSemaphore(self.max_connections)
        super().server_bind()

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # full: closed now, no thread for it
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def serve_metrics(registry: CollectorRegistry, port: int, host: str = "0.0.0.0",
                  read_timeout_s: float = READ_TIMEOUT_S,
                  max_connections: int = MAX_CONNECTIONS) -> WSGIServer:
    """Serves `registry` at http://host:port/metrics from a daemon thread; the server (its
    `server_address` says the port bound, its shutdown() stops it)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                flags=socket.AI_PASSIVE)[0][0]
    handler = type("Handler", (_Handler,), {"timeout": read_timeout_s})
    server_class = type("Server", (_BoundedServer,), {"address_family": family,
                                                      "max_connections": max_connections})
    server = server_class((host, port), handler)
    server.set_app(make_wsgi_app(registry))
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
