"""pagedgen_router_requests_total{code}: every client call that reaches routing counted once,
as it ended, over gRPC (unary and stream) and the HTTP front (which runs the same
RoutedRequest): OK, the status the router ended it with, CANCELLED when the client left. The
router counted only failures before, so no error ratio could be read. And a router without an
index exports no prefix_index_up (a constant 0 read as an index down).

The router runs in this process in front of one real engine (no index); clients call it over
loopback."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator

import grpc
import pytest
from prometheus_client import generate_latest

from engine_service.serving.validation import MAX_CACHE_SALT_CHARS
from openai_api.server import HttpServer
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from router.config import RouterConfig
from router.core import Router
from router.server import RouterServer
from tests.router.stack import RouterStack
from tests.support.frozen_relay import FrozenRelay, called_past_its_deadline_header_held

CODES = ("OK", "CANCELLED", "INVALID_ARGUMENT", "UNAVAILABLE")
SETTLE_S = 30.0


@pytest.fixture(scope="module")
def engine(tiny_llama_dir, tmp_path_factory, test_certs) -> Iterator[RouterStack]:
    with RouterStack(tiny_llama_dir, tmp_path_factory.mktemp("requests-total"), test_certs,
                     num_engines=1, with_index=False, with_router=False) as running:
        yield running


def http_call(url: str, body: dict | None = None) -> dict | str:
    """GET `url`, or POST `body` as JSON; the JSON answer, or a stream's text."""
    data = json.dumps(body).encode() if body is not None else None
    call = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(call, timeout=60) as answer:
        text = answer.read().decode()
    return text if body is not None and body.get("stream") else json.loads(text)


def request(max_tokens: int, request_id: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id, token_ids=pb.TokenIds(ids=list(range(100, 140))),
        sampling=pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))


@contextlib.asynccontextmanager
async def routing(engine: RouterStack) -> AsyncIterator[tuple[RouterServer, HttpServer]]:
    """A router (gRPC and HTTP) in front of the engine, routable, while the block runs."""
    [replica] = engine.engines.values()
    router = Router(RouterConfig(stats_interval_s=0.05), [replica.target], None,
                    tls=engine.certs.material("router"))
    http = HttpServer("127.0.0.1", 0)
    server = RouterServer(router, port=0, http=http, tls=engine.certs.material("router"))
    await server.start()
    try:
        deadline = time.monotonic() + SETTLE_S
        while not router.replicas.routable():
            assert time.monotonic() < deadline, "the engine never became routable"
            await asyncio.sleep(0.05)
        yield server, http
    finally:
        await server.stop(0)


def counter(server: RouterServer) -> Callable[[str], float]:
    def count(code: str) -> float:
        return server.router.metrics.registry.get_sample_value(
            "pagedgen_router_requests_total", {"code": code}) or 0.0
    return count


def test_every_call_is_counted_once_by_how_it_ended(engine):
    async def body() -> dict[str, float]:
        async with routing(engine) as (server, http):
            count = counter(server)
            async with engine.certs.aio_end_client_channel(f"127.0.0.1:{server.port}") as ch:
                stub = pb_grpc.GenerationStub(ch)
                reply = await stub.Generate(request(4), timeout=60)  # 1: OK
                assert reply.usage.completion_tokens == 4
                assert count("OK") == 1
                messages = [m async for m in stub.GenerateStream(request(4), timeout=60)]
                assert messages[-1].finished  # 2: OK
                # (counted as its handler ends, which may come after the client has the last
                # message)
                deadline = time.monotonic() + SETTLE_S
                while count("OK") < 2:
                    assert time.monotonic() < deadline, "the stream was not counted"
                    await asyncio.sleep(0.02)
                call = stub.GenerateStream(request(2000), timeout=60)  # 3: the client leaves
                first = await call.read()
                assert first is not grpc.aio.EOF and not first.finished
                call.cancel()
                deadline = time.monotonic() + SETTLE_S
                while count("CANCELLED") < 1:
                    assert time.monotonic() < deadline, "the cancel was not counted"
                    await asyncio.sleep(0.02)
                with pytest.raises(grpc.aio.AioRpcError) as refused:  # 4: refused
                    await stub.Generate(request(4, request_id="no spaces allowed"), timeout=60)
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert count("INVALID_ARGUMENT") == 1
                salted = request(4)  # 5: refused at the door, before routing
                salted.cache_salt = "s" * (MAX_CACHE_SALT_CHARS + 1)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Generate(salted, timeout=60)
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert count("INVALID_ARGUMENT") == 2
            base = f"http://127.0.0.1:{http.port}/v1"
            [model] = (await asyncio.to_thread(http_call, f"{base}/models"))["data"]
            body = {"model": model["id"], "prompt": list(range(100, 140)), "max_tokens": 4,
                    "temperature": 0}
            answer = await asyncio.to_thread(http_call, f"{base}/completions", body)  # 6: OK
            assert answer["usage"]["completion_tokens"] == 4
            streamed = await asyncio.to_thread(http_call, f"{base}/completions",
                                               body | {"stream": True})
            assert "[DONE]" in streamed  # 7: OK, streamed over HTTP
            await asyncio.sleep(0.2)  # (nothing more may be counted after the calls ended)
            return {code: count(code) for code in CODES}

    counts = asyncio.run(body())
    assert counts == {"OK": 4, "CANCELLED": 1, "INVALID_ARGUMENT": 2, "UNAVAILABLE": 0}


def test_a_call_its_client_ended_at_the_deadline_counts_deadline_exceeded(engine):
    """The client's deadline timer cancels its call a little before the router's (which
    started when the header was read: here held on the way): the deadline ended it, not
    a client that left."""
    async def body() -> dict[str, float]:
        async with routing(engine) as (server, _):
            count = counter(server)
            relay = FrozenRelay(server.port)
            async with relay.serving() as relayed, \
                    engine.certs.aio_end_client_channel(relayed) as channel:
                await called_past_its_deadline_header_held(
                    relay, pb_grpc.GenerationStub(channel), request(2), request(2000))
                deadline = time.monotonic() + SETTLE_S
                while count("OK") + count("CANCELLED") + count("DEADLINE_EXCEEDED") < 2:
                    assert time.monotonic() < deadline, "the call was not counted"
                    await asyncio.sleep(0.02)
            counts = {code: count(code) for code in ("OK", "CANCELLED", "DEADLINE_EXCEEDED")}
            # An error, as a stall or the replica's deadline is (a client's cancel is not).
            counts["failed"] = server.router.metrics.registry.get_sample_value(
                "pagedgen_router_requests_failed_total", {"code": "DEADLINE_EXCEEDED"}) or 0.0
            return counts

    counts = asyncio.run(body())
    assert counts == {"OK": 1, "CANCELLED": 0, "DEADLINE_EXCEEDED": 1, "failed": 1}


def test_a_router_without_an_index_exports_no_index_gauge():
    async def exported(index_target: str | None) -> bytes:
        router = Router(RouterConfig(), ["127.0.0.1:1"], index_target)
        try:
            return generate_latest(router.metrics.registry)
        finally:
            await router.replicas.close()
            if router.index is not None:
                await router.index.close()

    assert b"pagedgen_router_prefix_index_up" not in asyncio.run(exported(None))
    assert b"pagedgen_router_prefix_index_up 0.0" in asyncio.run(exported("127.0.0.1:2"))
