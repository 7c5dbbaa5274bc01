"""A client of the router that opens a GenerateStream and never reads it: once its next message
has waited unsent --send-stall-timeout-s, the router ends the call (DEADLINE_EXCEEDED naming
the flag, after what was sent), cancels the request at its replica and counts the stall. A
slow reader is not cut.

Before, the router read the replica's stream to its end (router/relay_buffer.py) and then held
the last of it, and the client's call, for as long as the client kept its connection."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
import urllib.request

import grpc
import pytest

from engine_service.tools.launch import EngineProcess
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from prefix_index.tools.redis_process import free_port
from router.tools.launch import RouterProcess

# (A slow reader here takes a message every quarter of it: margin for a loaded machine.)
STALL_TIMEOUT_S = 2.0
STALLS = "pagedgen_router_send_stalls_total"
# The client grants its stream no more window than it reads: what it does not read waits here.
SMALL_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024),
                ("grpc.use_local_subchannel_pool", 1)]
# ~60 KB of output (200 tokens, 20 logprobs): far past what the client's window takes.
UNREAD = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]),
                            sampling=pb.SamplingParams(max_tokens=200, ignore_eos=True,
                                                       logprobs=20))
LONG = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]),
                          sampling=pb.SamplingParams(max_tokens=1000, ignore_eos=True,
                                                     logprobs=20, n=16))


@pytest.fixture(scope="module")
def stack(tiny_llama_dir, tmp_path_factory, test_certs):
    logs = tmp_path_factory.mktemp("send_stall_router")
    engine = EngineProcess(tiny_llama_dir, ["--prefix-index", "none", "--num-blocks", "1100",
                                            "--max-model-len", "1024"],
                           log_path=logs / "engine.log", tls=test_certs.files("engine"))
    metrics_port, http_port = free_port(), free_port()
    with contextlib.ExitStack() as stack:
        stack.enter_context(engine.start())
        router = RouterProcess(["--engines", engine.target, "--prefix-index", "none",
                                "--send-stall-timeout-s", str(STALL_TIMEOUT_S),
                                "--metrics-port", str(metrics_port),
                                "--metrics-host", "127.0.0.1", "--http-port", str(http_port)],
                               log_path=logs / "router.log", tls=test_certs.files("router"))
        stack.enter_context(router.start())
        yield engine, router, metrics_port, http_port


def _metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


async def _until(predicate, what: str, timeout_s: float) -> float:
    started = time.monotonic()
    while not await predicate():
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"{what}: not reached after {timeout_s}s")
        await asyncio.sleep(0.05)
    return time.monotonic() - started


def test_an_unread_stream_is_ended_at_the_router(stack, test_certs):
    engine, router, metrics_port, _ = stack

    async def body():
        before = _metric(metrics_port, STALLS)
        async with test_certs.aio_end_client_channel(router.target, SMALL_WINDOW) as channel, \
                test_certs.aio_channel(engine.target) as engine_channel:
            # (A deadline far past the stall's: a stream left without its end fails here, not
            # at the suite's timeout; the client's own deadline names no flag.)
            unread = pb_grpc.GenerationStub(channel).GenerateStream(UNREAD, timeout=60)
            await unread.initial_metadata()

            async def counted() -> bool:
                return _metric(metrics_port, STALLS) == before + 1

            await _until(counted, "the stall counted", STALL_TIMEOUT_S * 10)
            engine_stub = pb_grpc.GenerationStub(engine_channel)

            async def engine_idle() -> bool:
                stats = await engine_stub.EngineStats(pb.EngineStatsRequest(), timeout=10)
                return stats.num_live_requests == 0

            await _until(engine_idle, "nothing left at the replica", 10)
            received = 0
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                async for message in unread:
                    received += sum(len(c.token_ids) for c in message.choices)
            assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, ended.value
            assert (f"the router's --send-stall-timeout-s {STALL_TIMEOUT_S:g}"
                    in ended.value.details())
            assert 0 < received < 200

    asyncio.run(body())


def test_an_unread_stream_whose_first_message_is_stuck_gets_its_end(stack, test_certs):
    """The first message alone is past the client's window: ending the call sent its headers
    again, which gRPC refused, and no status went (tests/service/test_send_stall.py)."""
    engine, router, metrics_port, _ = stack
    first_too_big = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[1, 2, 3]),
        sampling=pb.SamplingParams(max_tokens=4, ignore_eos=True, logprobs=20, n=16))
    deadline_s = 40.0

    async def body():
        before = _metric(metrics_port, STALLS)
        async with test_certs.aio_end_client_channel(router.target, SMALL_WINDOW) as channel:
            unread = pb_grpc.GenerationStub(channel).GenerateStream(first_too_big,
                                                                    timeout=deadline_s)
            await unread.initial_metadata()

            async def counted() -> bool:
                return _metric(metrics_port, STALLS) == before + 1

            await _until(counted, "the stall counted", STALL_TIMEOUT_S * 10)
            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                async for _ in unread:
                    pass
            assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, ended.value
            assert (f"the router's --send-stall-timeout-s {STALL_TIMEOUT_S:g}"
                    in ended.value.details())
            assert time.monotonic() - started < deadline_s / 2  # its end, not its deadline

    asyncio.run(body())


def test_a_slow_reader_is_not_cut_at_the_router(stack, test_certs):
    engine, router, metrics_port, _ = stack

    async def body():
        before = _metric(metrics_port, STALLS)
        async with test_certs.aio_end_client_channel(router.target, SMALL_WINDOW) as channel:
            call = pb_grpc.GenerationStub(channel).GenerateStream(LONG)
            started = time.monotonic()
            tokens = 0
            finished = False
            while not finished:
                message = await call.read()
                assert message is not grpc.aio.EOF
                tokens += sum(len(c.token_ids) for c in message.choices)
                finished = message.finished
                await asyncio.sleep(STALL_TIMEOUT_S / 4)
            assert await call.code() == grpc.StatusCode.OK
            assert tokens == 16000
            assert time.monotonic() - started > STALL_TIMEOUT_S  # read for longer
        assert _metric(metrics_port, STALLS) == before

    asyncio.run(body())


def test_an_unread_http_stream_is_counted_as_a_stall_not_a_cancel(stack, test_certs):
    """The router's HTTP front ends a stream whose client takes nothing (it closes the
    connection) and says so to its calls, one a prompt: requests_total counts each
    DEADLINE_EXCEEDED, as a gRPC stream the watch ends, not CANCELLED (a client that left),
    nor OK (a list of prompts ran to its end into the front's queue whatever the client
    took), which it did before."""
    _, _, metrics_port, http_port = stack
    ended = 'pagedgen_router_requests_total{code="DEADLINE_EXCEEDED"}'
    cancelled = 'pagedgen_router_requests_total{code="CANCELLED"}'
    ok = 'pagedgen_router_requests_total{code="OK"}'
    before = {name: _metric(metrics_port, name) for name in (STALLS, ended, cancelled, ok)}
    # ~6 MB of events (2 prompts x 16 sequences of 500 tokens, 5 logprobs): past every
    # buffer between.
    body = json.dumps({"prompt": ["Count to a thousand.", "Count to ten."], "stream": True,
                       "max_tokens": 500, "n": 16, "logprobs": 5, "ignore_eos": True}).encode()
    raw = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window
    raw.settimeout(30)
    raw.connect(("127.0.0.1", http_port))
    with test_certs.ssl_context().wrap_socket(raw, server_hostname="127.0.0.1") as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: " + str(len(body)).encode()
                     + b"\r\n\r\n" + body)
        assert sock.recv(1).startswith(b"H")  # the stream started, then nothing is read
        deadline = time.monotonic() + STALL_TIMEOUT_S * 15
        while _metric(metrics_port, STALLS) < before[STALLS] + 1:
            assert time.monotonic() < deadline, "the unread HTTP stream was not ended"
            time.sleep(0.1)
        while _metric(metrics_port, ended) < before[ended] + 2:
            assert time.monotonic() < deadline, "the unread HTTP stream's calls not counted"
            time.sleep(0.1)
        assert _metric(metrics_port, STALLS) == before[STALLS] + 1
        assert _metric(metrics_port, cancelled) == before[cancelled]
        assert _metric(metrics_port, ok) == before[ok]
