"""A client that opens a streamed completion and never reads it has its connection closed and
its stream ended (which stops its request) once it has taken nothing for
--send-stall-timeout-s; a slow reader, which takes a little at a time, is not cut.

Before, the stream's write waited for good (uvicorn's send waits while the connection's
buffer is full): the request held its queue slot and its output as long as the client kept
the connection open. The servicer here is a stand-in that streams text without end, so the
HTTP API's own writes are what is tested, on a real loopback server and raw sockets."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time

import pytest

from openai_api.server import HttpServer
from pagedgen_api import generation_pb2 as pb
from tests.http.http_util import serving

STALL_TIMEOUT_S = 2.0
EVENT_TEXT = "x" * 4000  # ~4 KB an event
REQUEST = json.dumps({"model": "m", "prompt": "hi", "stream": True, "max_tokens": 8}).encode()


class EndlessServicer:
    """Streams a message every few milliseconds until its stream is closed."""

    def __init__(self) -> None:
        self.open_streams = 0
        self.closed_streams = 0

    async def GenerateStream(self, request, context):
        self.open_streams += 1
        try:
            while True:
                await asyncio.sleep(0.002)
                yield pb.GenerateStreamResponse(
                    request_id="r", choices=[pb.Completion(index=0, text=EVENT_TEXT,
                                                           token_ids=[1])])
        finally:
            self.open_streams -= 1
            self.closed_streams += 1


@pytest.fixture
def server():
    servicer = EndlessServicer()
    http = HttpServer("127.0.0.1", 0, send_stall_timeout_s=STALL_TIMEOUT_S)
    with serving(http, servicer) as port:
        yield port, servicer


def _open_stream(port: int, receive_buffer: int | None = 4096) -> socket.socket:
    """A streamed completion, its request sent, on a socket with a small receive buffer or
    (None) the kernel's default, which grows to megabytes."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if receive_buffer is not None:  # (before connect: it sets the window)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.settimeout(10)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: " + str(len(REQUEST)).encode() + b"\r\n\r\n" + REQUEST)
    return sock


def _wait(predicate, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not reached after {timeout_s}s")
        time.sleep(0.05)


def test_a_client_that_never_reads_is_closed_and_its_stream_ended(server):
    port, servicer = server
    with _open_stream(port) as sock:
        _wait(lambda: servicer.open_streams == 1, "the stream started", 10)
        started = time.monotonic()
        # Never read: the stream ends (the request would be stopped) within a few timeouts.
        _wait(lambda: servicer.closed_streams == 1, "the unread stream ended",
              STALL_TIMEOUT_S * 5)
        assert time.monotonic() - started >= STALL_TIMEOUT_S
        # And the connection is gone (aborted: what was buffered for it is dropped).
        received = 0
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(65536):
                received += len(chunk)
        assert received < 64 << 20


# What the server sees of a reader far behind is TCP's window updates, and Linux sends one only
# once a segment's worth of window (an MSS: ~1.4 KB over Ethernet, 64 KiB over loopback) is free
# again, which takes reading up to about twice that (the buffer's bookkeeping counts too): 96 KiB
# a second was not seen here. These take 256 KiB a second, far slower than the stream (~2 MB/s),
# with the kernel's default buffers; the small-buffer one takes an event's worth (4 KB) a second.
@pytest.mark.parametrize("receive_buffer,taken_a_second", [(4096, len(EVENT_TEXT)),
                                                           (None, 256 << 10)])
def test_a_slow_reader_is_not_cut(server, receive_buffer, taken_a_second):
    port, servicer = server
    with _open_stream(port, receive_buffer) as sock:
        _wait(lambda: servicer.open_streams == 1, "the stream started", 10)
        for _ in range(int(STALL_TIMEOUT_S * 3)):  # for three timeouts
            time.sleep(1.0)
            taken = 0
            while taken < taken_a_second:
                chunk = sock.recv(taken_a_second - taken)
                assert chunk, "the server closed a slow reader's connection"
                taken += len(chunk)
        assert servicer.open_streams == 1 and servicer.closed_streams == 0
    _wait(lambda: servicer.closed_streams == 1, "the stream ended with its client", 10)
