"""A request body's deadline is a progress timeout: a body that keeps arriving, however slowly
in all, is read (an honest 10 MB body at 100 KB/s took 100 s, past the 60 s the whole body
had before, and got 408); one with nothing arriving for --body-timeout is answered 408, and
so is one that trickles below BODY_MIN_BYTES_PER_S past its first timeout (a byte every few
seconds, which the progress timeout alone would let hold its handler for ever)."""

from __future__ import annotations

import contextlib
import json
import socket
import time

import pytest

from openai_api.app import BODY_MIN_BYTES_PER_S
from openai_api.server import HttpServer
from pagedgen_api import generation_pb2 as pb
from tests.http.http_util import serving

BODY_TIMEOUT_S = 0.5


class TokenizingServicer:
    async def Tokenize(self, request, context):
        return pb.TokenizeResponse(token_ids=[1, 2, 3], prompt=request.text)


@pytest.fixture
def server():
    with serving(HttpServer("127.0.0.1", 0, body_timeout_s=BODY_TIMEOUT_S),
                 TokenizingServicer()) as port:
        yield port


def _body(size: int) -> bytes:
    body = json.dumps({"model": "m", "prompt": "hi"}).encode()
    return body + b" " * (size - len(body))  # (JSON allows trailing whitespace)


def _post(port: int, body: bytes, pieces: int, gap_s: float, sent: int | None = None
          ) -> tuple[int, dict]:
    """POST /tokenize with `body` in `pieces` parts `gap_s` apart (only its first `sent` bytes
    when given); the status and JSON answer."""
    sent = len(body) if sent is None else sent
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")
        step = -(-sent // pieces)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for start in range(0, sent, step):
                time.sleep(gap_s)
                sock.sendall(body[start:start + step])
        data = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(65536):
                data += chunk
                head, _, rest = data.partition(b"\r\n\r\n")
                if rest and rest.count(b"{") == rest.count(b"}"):
                    break
    head, _, rest = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(rest)


def test_a_slow_body_that_keeps_arriving_is_read(server):
    # 8 times the timeout in all, a part every 0.4 timeouts, ~2.5 KB/s: above the pace.
    started = time.monotonic()
    status, answer = _post(server, _body(10_000), pieces=20, gap_s=BODY_TIMEOUT_S * 0.2)
    assert time.monotonic() - started > BODY_TIMEOUT_S * 3
    assert status == 200, answer
    assert answer["tokens"] == [1, 2, 3]


def test_a_body_that_stops_arriving_is_answered_408(server):
    status, answer = _post(server, _body(10_000), pieces=10, gap_s=BODY_TIMEOUT_S * 0.2,
                           sent=5_000)
    assert status == 408, answer
    error = answer["error"]
    assert error["code"] == "request_timeout"
    assert error["message"].startswith(
        f"the request body stopped arriving: no byte for {BODY_TIMEOUT_S:g} s, after 5000 "
        f"bytes of 10000 in "), error


def test_a_body_trickling_below_the_pace_is_answered_408(server):
    # A byte every 0.3 timeouts: never BODY_TIMEOUT_S without one, but far below the pace.
    assert 1 / (BODY_TIMEOUT_S * 0.3) < BODY_MIN_BYTES_PER_S
    status, answer = _post(server, _body(10_000), pieces=40, gap_s=BODY_TIMEOUT_S * 0.3,
                           sent=40)
    assert status == 408, answer
    assert answer["error"]["message"].startswith(
        f"the request body must arrive at {BODY_MIN_BYTES_PER_S} bytes/s or more past its "
        f"first {BODY_TIMEOUT_S:g} s, got "), answer
