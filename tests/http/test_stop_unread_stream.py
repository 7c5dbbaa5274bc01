"""A stream whose client stopped reading, still open when the HTTP API stops, is ended as a
client leaving would end it (its connection closed, its work cancelled), with one WARNING
counting such responses; so is a whole response the client has not taken (its bytes still
held here), while one a client is reading gets the drain's grace to finish.

Before, uvicorn cancelled it at its own deadline and logged an ERROR ("Cancel 1 running
task(s)") and an "Exception in ASGI application" with a traceback at every stop that found a
frozen client, though no server code had failed. The servicer here is a stand-in that streams
text without end, so the HTTP API's own stop is what is tested, on a real loopback server."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import pytest

from openai_api.server import HttpServer
from pagedgen_api import generation_pb2 as pb
from tests.http.http_util import serving
from tests.http.test_send_stall_http import EndlessServicer, _open_stream, _wait

BIG_TEXT_BYTES = 8_000_000  # far past the socket buffers of both ends


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_an_unread_stream_open_at_the_stop_is_closed_without_an_error():
    servicer = EndlessServicer()
    # No stall watch: only the stop ends this stream.
    http = HttpServer("127.0.0.1", 0, send_stall_timeout_s=0)
    records = Records()
    # uvicorn's loggers do not propagate to the root logger, and its start sets their
    # handlers (its own logging config): watched once it has started.
    watched = [logging.getLogger(name) for name in ("uvicorn.error", "openai_api.server")]
    sock = None
    try:
        with serving(http, servicer) as port:
            for logger in watched:
                logger.addHandler(records)
            sock = _open_stream(port)  # open past the stop: the client never leaves
            _wait(lambda: servicer.open_streams == 1, "the stream started", 10)
            # A 4 KB receive buffer: the server's writes fill it and its own send buffer in
            # milliseconds (~2 MB/s of events); the client never reads.
            time.sleep(1.0)
            assert servicer.closed_streams == 0
        # (serving's exit stopped the server, with a 0.1 s grace)
    finally:
        for logger in watched:
            logger.removeHandler(records)
        if sock is not None:
            sock.close()
    assert servicer.closed_streams == 1 and servicer.open_streams == 0
    errors = [f"{r.name}: {r.getMessage()}" for r in records.records
              if r.levelno >= logging.ERROR]
    assert not errors, errors
    warnings = [r.getMessage() for r in records.records if r.levelno == logging.WARNING]
    assert any(m.startswith("1 HTTP responses still unfinished") for m in warnings), warnings


class BigAnswer:
    """One non-streamed completion of BIG_TEXT_BYTES: complete as soon as it is written, its
    bytes waiting in the server's buffers for the client."""

    def __init__(self) -> None:
        self.answered = threading.Event()

    async def Generate(self, request, context):
        self.answered.set()
        return pb.GenerateResponse(request_id="r", completions=[
            pb.Completion(index=0, text="x" * BIG_TEXT_BYTES, token_ids=[1])])


def _ask(port: int) -> socket.socket:
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 8}).encode()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(30)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return sock


def _read_all(sock: socket.socket, into: list[bytes]) -> None:
    while chunk := sock.recv(1 << 16):
        into.append(chunk)


@pytest.mark.parametrize("client_reads", [False, True])
def test_a_whole_answer_not_taken_yet_at_the_stop(client_reads):
    servicer = BigAnswer()
    http = HttpServer("127.0.0.1", 0, send_stall_timeout_s=0)
    records = Records()
    watched = [logging.getLogger(name) for name in ("uvicorn.error", "openai_api.server")]
    received: list[bytes] = []
    sock = reader = None
    try:
        # A reader gets a long grace, which it must not need to wait out; a frozen client a
        # short one.
        with serving(http, servicer, grace_s=30.0 if client_reads else 0.1) as port:
            for logger in watched:
                logger.addHandler(records)
            sock = _ask(port)
            assert servicer.answered.wait(10)
            time.sleep(0.5)  # the answer written: what the client has not taken waits here
            if client_reads:
                reader = threading.Thread(target=_read_all, args=(sock, received))
                reader.start()
        if reader is not None:
            reader.join(30)
    finally:
        for logger in watched:
            logger.removeHandler(records)
        if sock is not None:
            sock.close()
    errors = [f"{r.name}: {r.getMessage()}" for r in records.records
              if r.levelno >= logging.ERROR]
    assert not errors, errors
    warnings = [r.getMessage() for r in records.records if r.levelno == logging.WARNING]
    if client_reads:  # all of it, and nothing cut
        head, _, body = b"".join(received).partition(b"\r\n\r\n")
        assert b"200 OK" in head and json.loads(body)["choices"][0]["text"] == "x" * BIG_TEXT_BYTES
        assert not warnings, warnings
    else:
        assert any(m.startswith("1 HTTP responses still unfinished") for m in warnings), warnings
