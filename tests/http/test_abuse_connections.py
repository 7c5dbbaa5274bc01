"""Clients that hold HTTP connections without finishing a request (slowloris), and too many
connections at once: each is bounded (openai_api/connection_guard.py, app.py's body deadline),
answered in OpenAI's error shape where an answer can go, and the server serves on.

Before, uvicorn kept a connection that sent no request, a head a byte at a time or a body that
never ended for good: 600 of them were all still open after 70 s, each a file descriptor of
the process that also accepts the engine's gRPC connections."""

from __future__ import annotations

import json
import socket
import time

import pytest

from openai_api.server import HttpServer
from tests.http.http_util import call, serving
from tests.support.tls import SessionCerts

HEAD_TIMEOUT_S = 0.5
BODY_TIMEOUT_S = 0.5
MAX_CONNECTIONS = 8


class _Servicer:  # the requests here never get as far as the servicer
    pass


@pytest.fixture
def server():
    http = HttpServer("127.0.0.1", 0, head_timeout_s=HEAD_TIMEOUT_S,
                      body_timeout_s=BODY_TIMEOUT_S, max_connections=MAX_CONNECTIONS)
    with serving(http, _Servicer()) as port:
        yield port


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def _read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection (a timeout fails the test)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _read_response(sock: socket.socket) -> bytes:
    """One whole response on a kept-alive connection (its head and Content-Length's body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += _recv(sock, data)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        chunk = _recv(sock, data)
        data, body = data + chunk, body + chunk
    return data


def _recv(sock: socket.socket, so_far: bytes) -> bytes:
    chunk = sock.recv(65536)
    assert chunk, f"the server closed the connection mid-response, after {so_far!r}"
    return chunk


def _error(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def test_a_connection_that_sends_nothing_is_closed(server):
    with _connect(server) as sock:
        started = time.monotonic()
        assert _read_all(sock) == b""  # closed, nothing said: no request to answer
        assert time.monotonic() - started < HEAD_TIMEOUT_S + 5


def test_a_head_sent_a_byte_at_a_time_is_answered_408(server):
    with _connect(server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        for _ in range(3):  # still sending, but the head never ends
            time.sleep(HEAD_TIMEOUT_S / 4)
            sock.sendall(b"X")
        status, error = _error(_read_all(sock))
    assert status == 408 and error["code"] == "request_timeout"
    assert f"must arrive within {HEAD_TIMEOUT_S:g} s" in error["message"], error


def test_a_body_that_never_ends_is_answered_408(server):
    with _connect(server) as sock:
        sock.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{")
        status, error = _error(_read_all(sock))
    assert status == 408 and error["code"] == "request_timeout"
    assert error["message"] == (f"the request body must arrive within {BODY_TIMEOUT_S:g} s of "
                                f"its head, got 1 bytes of 100 by then")


def test_a_head_in_time_is_served_and_keep_alive_rearms(server):
    with _connect(server) as sock:
        for _ in range(2):  # the second head is awaited from the end of the first response
            sock.sendall(b"GET /health HTTP/1.1\r\n")
            time.sleep(HEAD_TIMEOUT_S / 3)
            sock.sendall(b"Host: x\r\n\r\n")
            response = _read_response(sock)
            assert response.startswith(b"HTTP/1.1 200"), response


def test_connections_past_the_limit_are_refused_503_and_the_server_serves_on(server):
    held = [_connect(server) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.1)  # accepted by the server's loop
        with _connect(server) as extra:
            status, error = _error(_read_all(extra))
        assert status == 503 and error["code"] == "too_many_connections"
        assert f"must be at most {MAX_CONNECTIONS}, got {MAX_CONNECTIONS + 1}" in error["message"]
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.2)  # their closes reach the server
    assert call(f"http://127.0.0.1:{server}/health")[0] == 200


def test_a_pipelined_request_running_past_the_head_timeout_is_answered():
    # The second request's head comes with the first: it is in when the first response ends,
    # so no head is awaited then. Its body comes only after twice the head timeout (within the
    # body's own deadline); the head timer closed the connection with that request running.
    with serving(HttpServer("127.0.0.1", 0, head_timeout_s=HEAD_TIMEOUT_S, body_timeout_s=5.0,
                            max_connections=MAX_CONNECTIONS), _Servicer()) as port, \
            _connect(port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
                     b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1\r\n\r\n")
        first = _read_response(sock)
        assert first.startswith(b"HTTP/1.1 200"), first
        time.sleep(2 * HEAD_TIMEOUT_S)
        sock.sendall(b"{")  # not JSON: answered 400, but answered
        second = _read_response(sock)
        assert second.startswith(b"HTTP/1.1 400"), second


def _closed_within(sock: socket.socket, within_s: float) -> bool:
    sock.settimeout(within_s)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_tls_connections_that_never_say_hello_are_counted_and_timed(tmp_path):
    # asyncio hands a TLS connection to the HTTP protocol after its handshake only: one that
    # sent no ClientHello was counted nowhere and held its descriptor 60 s (asyncio's default).
    certs = SessionCerts.make(tmp_path)
    http = HttpServer("127.0.0.1", 0, tls=certs.files("engine").load(),
                      head_timeout_s=HEAD_TIMEOUT_S, body_timeout_s=BODY_TIMEOUT_S,
                      max_connections=MAX_CONNECTIONS)
    with serving(http, _Servicer()) as port:
        silent = [_connect(port) for _ in range(MAX_CONNECTIONS)]
        try:
            time.sleep(0.1)  # accepted by the server's loop
            with _connect(port) as extra:  # past the bound: closed at once, no handshake
                assert _closed_within(extra, HEAD_TIMEOUT_S / 2)
            started = time.monotonic()
            assert all(_closed_within(sock, HEAD_TIMEOUT_S + 5) for sock in silent)
            assert time.monotonic() - started < HEAD_TIMEOUT_S + 2
        finally:
            for sock in silent:
                sock.close()
        time.sleep(0.2)  # their closes reach the server
        status, _ = call(f"https://127.0.0.1:{port}/health", context=certs.ssl_context())
        assert status == 200
