"""A request body past the HTTP API's limit is refused with a 413 in OpenAI's shape before it is
read whole: the server holds several times a body's size while parsing it, so one huge body
(no key is needed by default) could take the engine's memory, and its requests with it."""

from __future__ import annotations

import json
import select
import socket
import ssl
import time

import pytest

from openai_api.schemas import MAX_BODY_BYTES
from pagedgen_api import generation_pb2 as pb
from tests.http.conftest import API_KEY


def _raw_post(port: int, head: str, body_chunks,
              context: ssl.SSLContext) -> tuple[int, dict]:
    """POST over a bare TLS socket, sending and reading at once from this one thread (the
    server may answer and close before the body is all sent); returns the status and the JSON
    body of the answer. One thread: an SSL socket must not be read and written from two at
    once (OpenSSL's objects are not thread-safe; a sender thread once left recv hanging)."""
    data = head.encode() + b"".join(body_chunks)
    deadline = time.monotonic() + 60
    with socket.create_connection(("127.0.0.1", port), timeout=60) as raw, \
            context.wrap_socket(raw, server_hostname="127.0.0.1") as sock:
        sock.setblocking(False)
        sent, reply = 0, b""
        while b"\r\n\r\n" not in reply or len(reply.split(b"\r\n\r\n", 1)[1]) < _length(reply):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no whole answer in 60 s: {reply[:200]!r}")
            sending = sent < len(data)
            readable, writable, _ = select.select([sock], [sock] if sending else [], [], 1.0)
            if readable or sock.pending():
                try:
                    received = sock.recv(65536)
                except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                    received = None
                if received == b"":
                    break
                reply += received or b""
            if writable and sending:
                try:
                    sent += sock.send(data[sent:sent + (1 << 16)])
                except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                    pass
                except OSError:
                    sent = len(data)  # answered and closed early: the point of the limit
    status = int(reply.split(b" ", 2)[1])
    return status, json.loads(reply.split(b"\r\n\r\n", 1)[1][:_length(reply)])


def _length(reply: bytes) -> int:
    for line in reply.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 1 << 30


def _head(length_header: str) -> str:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\n{length_header}\r\n")


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_body_past_the_limit_is_413_and_the_engine_serves_on(http_engine, engine_stub,
                                                               framing):
    filler = b"x" * (1 << 20)
    count = MAX_BODY_BYTES // len(filler) + 2
    if framing == "content-length":  # declared too large: refused on the header alone
        head = _head(f"Content-Length: {20 * MAX_BODY_BYTES}\r\n")
        chunks = [b'{"prompt": "', filler]
    else:  # no length declared: refused once what arrived passes the limit
        head = _head("Transfer-Encoding: chunked\r\n")
        chunks = [b"%x\r\n%s\r\n" % (len(filler), filler) for _ in range(count)]
    status, body = _raw_post(http_engine.http_port, head, chunks,
                             http_engine.certs.ssl_context())
    assert status == 413, body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert str(MAX_BODY_BYTES) in body["error"]["message"], body
    # Nothing else lost: the engine answers the next request, with nothing left live.
    status, reply = http_engine.call(f"{http_engine.base_url}/v1/completions",
                         {"model": http_engine.model, "prompt": "Hi", "max_tokens": 2}, API_KEY)
    assert status == 200 and reply["choices"], reply
    stats = engine_stub.EngineStats(pb.EngineStatsRequest(), timeout=10)
    assert stats.num_live_requests == 0
