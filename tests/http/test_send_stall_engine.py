"""The engine's HTTP API (HTTPS, a real engine): a client that asks for a streamed completion and
never reads it has its connection closed once it took nothing for --send-stall-timeout-s, its
request is stopped, the engine's only queue slot is free again, and the stall is counted.

Before, the stream's write waited for good and the request held the slot (the queue limit
counts open calls): every later request was refused 429 while the client kept its socket."""

from __future__ import annotations

import contextlib
import json
import socket
import time

import pytest

from tests.http.conftest import start_engine

STALL_TIMEOUT_S = 1.0
# ~6 MB of events (16 sequences of 1000 tokens, 5 logprobs each): past every buffer between
# (the kernel's send queue alone grew to 3.5 MB on loopback).
REQUEST = json.dumps({"prompt": "Count to a thousand.", "stream": True, "max_tokens": 1000,
                      "n": 16, "logprobs": 5, "ignore_eos": True}).encode()


@pytest.fixture(scope="module")
def engine(tiny_llama_dir, tmp_path_factory, test_certs):
    log_path = tmp_path_factory.mktemp("send_stall_http") / "engine.log"
    engine = start_engine(tiny_llama_dir, log_path, test_certs,
                          ["--send-stall-timeout-s", str(STALL_TIMEOUT_S),
                           "--max-live-requests", "1", "--num-blocks", "1100",
                           "--max-model-len", "1024"])
    try:
        yield engine
    finally:
        engine.process.terminate()


def _wait(predicate, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not reached after {timeout_s}s")
        time.sleep(0.05)


def _served(engine) -> bool:
    status, _ = engine.call(f"{engine.base_url}/v1/completions",
                            {"prompt": "Hi", "max_tokens": 2})
    assert status in (200, 429), status
    return status == 200


def test_an_unread_http_stream_is_closed_and_frees_the_slot(engine, test_certs):
    stalls = "pagedgen_engine_send_stalls_total"
    ended = 'pagedgen_engine_requests_total{code="DEADLINE_EXCEEDED"}'
    cancelled = 'pagedgen_engine_requests_total{code="CANCELLED"}'
    before = engine.metric(stalls)
    before_ended, before_cancelled = engine.metric(ended), engine.metric(cancelled)
    raw = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window
    raw.settimeout(30)
    raw.connect(("127.0.0.1", engine.http_port))
    with test_certs.ssl_context().wrap_socket(raw, server_hostname="127.0.0.1") as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: " + str(len(REQUEST)).encode()
                     + b"\r\n\r\n" + REQUEST)
        assert sock.recv(1).startswith(b"H")  # the stream started, then nothing is read
        # Meanwhile the slot is taken: another request is refused (429).
        assert not _served(engine)
        # The stall starts only once the events written fill every buffer between: a few MB
        # made and sent first, most of this test's 6.5 s when run alone, over 10 s in a
        # loaded run of the suite. The unread request cannot end by itself before then.
        _wait(lambda: engine.metric(stalls) == before + 1, "the stall counted", 60)
        _wait(lambda: _served(engine), "a request served once the unread one ended", 30)
        # Counted as a stall ends a gRPC stream (it was CANCELLED, as a client that left).
        assert engine.metric(ended) == before_ended + 1
        assert engine.metric(cancelled) == before_cancelled
        with contextlib.suppress(OSError):  # aborted: a reset, or what was in flight, then EOF
            while sock.recv(65536):
                pass
