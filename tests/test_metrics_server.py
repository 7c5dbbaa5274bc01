"""The metrics port holds no connection for long and no more than its bound at once: idle
connections held a thread each for as long as they stayed open (prometheus_client's server)."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from prefix_index.tools.metrics_server import serve_metrics


@pytest.fixture
def metrics():
    registry = CollectorRegistry()
    Counter("pagedgen_test_scrapes", "A counter to find in the scrape.", registry=registry).inc()
    server = serve_metrics(registry, 0, "127.0.0.1", read_timeout_s=0.5, max_connections=4)
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return reply.read().decode()


def scrape_when_a_slot_is_free(port: int, within_s: float) -> str:
    """A scrape, retried while the server still refuses it: a connection cut at its deadline
    reads EOF at once, but its thread gives the slot back only once it has seen the cut."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return scrape(port)
        except OSError:  # (RemoteDisconnected, a reset, or urllib's URLError around one)
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def closed_by_server(sock: socket.socket, within_s: float) -> bool:
    sock.settimeout(within_s)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False


def test_idle_connections_are_closed_and_past_the_bound_refused(metrics):
    assert "pagedgen_test_scrapes_total 1.0" in scrape(metrics)
    threads_before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", metrics)) for _ in range(4)]
    time.sleep(0.2)  # each taken by a thread of the server
    extra = socket.create_connection(("127.0.0.1", metrics))
    try:
        assert closed_by_server(extra, 2.0), "a connection past the bound was served"
        assert threading.active_count() <= threads_before + 4
        # Idle ones go once their read times out; the port serves again.
        assert all(closed_by_server(sock, 5.0) for sock in idle)
        assert "pagedgen_test_scrapes_total 1.0" in scrape_when_a_slot_is_free(metrics, 2.0)
    finally:
        for sock in [*idle, extra]:
            sock.close()


def test_it_binds_an_ipv6_address():
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    try:
        server = serve_metrics(CollectorRegistry(), 0, "::1")
    except OSError:
        pytest.skip("::1 cannot be bound here")
    try:
        port = server.server_address[1]
        with urllib.request.urlopen(f"http://[::1]:{port}/metrics", timeout=5) as reply:
            assert reply.status == 200
    finally:
        server.shutdown()
        server.server_close()


def test_a_trickling_client_is_cut_at_the_deadline_and_scrapes_go_on(metrics):
    # Each header byte comes well within the socket's read timeout (0.5 s), so only a deadline
    # per connection cuts them: before, 4 such clients held every slot and refused each scrape.
    trickling = [socket.create_connection(("127.0.0.1", metrics)) for _ in range(4)]
    stop = threading.Event()

    def trickle(sock: socket.socket) -> None:
        request = b"GET /metrics HTTP/1.1\r\n" + b"X" * 100
        for byte in request:
            if stop.wait(0.2):
                return
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                return  # cut by the server

    senders = [threading.Thread(target=trickle, args=(sock,), daemon=True) for sock in trickling]
    started = time.monotonic()
    for sender in senders:
        sender.start()
    try:
        assert all(closed_by_server(sock, 2.0) for sock in trickling)
        assert time.monotonic() - started < 1.5, "cut later than ~1 s"
        assert "pagedgen_test_scrapes_total 1.0" in scrape_when_a_slot_is_free(metrics, 2.0)
    finally:
        stop.set()
        for sender in senders:
            sender.join(timeout=5)
        for sock in trickling:
            sock.close()
