"""The engine counts every generation call once, by how it ended (requests_total{code}), over
gRPC and HTTP alike: requests_finished counts sequences and puts deadlines and failures under
'abort', so errors could not be told from cancels at the engine."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.error
import urllib.request

import grpc

from engine_service.core.config import EngineConfig
from engine_service.core.engine import LLMEngine
from engine_service.serving.server import EngineServer, ServerOptions
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from prefix_index.tools.redis_process import free_port
from tests.support.frozen_relay import FrozenRelay, called_past_its_deadline_header_held

CODES = ("OK", "CANCELLED", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED")


def http_post(certs, url: str, body: dict) -> int:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60,
                                    context=certs.ssl_context("client")) as reply:
            reply.read()
            return reply.status
    except urllib.error.HTTPError as error:
        return error.code


def request(max_tokens: int, request_id: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=[5, 6, 7]),
                              sampling=pb.SamplingParams(max_tokens=max_tokens,
                                                         ignore_eos=True))


def test_every_generation_call_is_counted_once_by_how_it_ended(tiny_llama_dir, test_certs):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), num_blocks=256))

    async def body() -> dict[str, float]:
        server = EngineServer(engine, ServerOptions(
            port=0, http_port=free_port(), tls=test_certs.material("engine")))
        port = await server.start()

        def count(code: str) -> float:
            return server.metrics.registry.get_sample_value(
                "pagedgen_engine_requests_total", {"code": code}) or 0.0

        try:
            async with test_certs.aio_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.GenerationStub(channel)
                await stub.Generate(request(4), timeout=60)  # OK
                assert [m async for m in stub.GenerateStream(request(4), timeout=60)]  # OK
                call = stub.GenerateStream(request(1000), timeout=60)  # the client leaves
                await call.read()
                call.cancel()
                while count("CANCELLED") < 1:
                    await asyncio.sleep(0.02)
                try:  # refused at admission
                    await stub.Generate(request(4, "no spaces allowed"), timeout=60)
                except grpc.aio.AioRpcError as error:
                    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
                try:  # past its deadline
                    await stub.Generate(request(1000), timeout=0.5)
                except grpc.aio.AioRpcError as error:
                    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            base = f"https://127.0.0.1:{server.http.port}/v1/completions"
            ok = {"prompt": [5, 6, 7], "max_tokens": 2, "model": tiny_llama_dir.name}
            assert await asyncio.to_thread(http_post, test_certs, base, ok) == 200  # OK
            bad = ok | {"max_tokens": -1}  # refused by the servicer over HTTP
            assert await asyncio.to_thread(http_post, test_certs, base, bad) == 400
            await asyncio.sleep(0.2)  # (nothing is counted after a call ended)
            return {code: count(code) for code in CODES}
        finally:
            await server.stop(0)

    counts = asyncio.run(body())
    assert counts == {"OK": 3, "CANCELLED": 1, "INVALID_ARGUMENT": 2, "DEADLINE_EXCEEDED": 1}


def test_a_call_its_client_ended_at_the_deadline_counts_deadline_exceeded(tiny_llama_dir,
                                                                           test_certs):
    """The client's deadline timer cancels its call; the engine's timer for the same deadline
    started when the header was read, later. The client's cancel arriving first (here: the
    header held on the way, as a loaded host or a slow link does) is the deadline's
    end, not a client that left. It counted CANCELLED (seen in CI, without the hold)."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), num_blocks=256))

    async def body() -> dict[str, float]:
        server = EngineServer(engine, ServerOptions(port=0, tls=test_certs.material("engine")))
        port = await server.start()
        relay = FrozenRelay(port)

        def count(code: str) -> float:
            return server.metrics.registry.get_sample_value(
                "pagedgen_engine_requests_total", {"code": code}) or 0.0

        try:
            async with relay.serving() as relayed, test_certs.aio_channel(relayed) as channel:
                await called_past_its_deadline_header_held(
                    relay, pb_grpc.GenerationStub(channel), request(2), request(1000))
                counted_by = time.monotonic() + 30
                while sum(count(code) for code in CODES) < 2:
                    assert time.monotonic() < counted_by, "the call was not counted"
                    await asyncio.sleep(0.02)
            return {code: count(code) for code in CODES}
        finally:
            await server.stop(0)

    counts = asyncio.run(body())
    assert counts == {"OK": 1, "CANCELLED": 0, "INVALID_ARGUMENT": 0, "DEADLINE_EXCEEDED": 1}


def test_a_refusal_is_counted_before_its_client_has_it(tiny_llama_dir):
    """A scrape made as the client holds its refusal sees it counted: counted as the handler
    unwound, after the status went out, it was missing in 18 of 50 such reads (a client on
    another thread, as in another process, and the server's loop busy with streams)."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), num_blocks=256))

    async def body() -> list[str]:
        server = EngineServer(engine, ServerOptions(port=0))
        port = await server.start()

        def count() -> float:
            return server.metrics.registry.get_sample_value(
                "pagedgen_engine_requests_total", {"code": "INVALID_ARGUMENT"}) or 0.0

        def refused_calls(missed: list[str]) -> None:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.GenerationStub(channel)
                for i in range(40):
                    before = count()
                    bad = request(4, "no spaces allowed")
                    with contextlib.suppress(grpc.RpcError):
                        if i % 2:
                            list(stub.GenerateStream(bad, timeout=60))
                        else:
                            stub.Generate(bad, timeout=60)
                    if count() != before + 1:
                        missed.append(f"call {i}: {count() - before}")

        missed: list[str] = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.GenerationStub(channel)
                busy = [stub.GenerateStream(request(2000)) for _ in range(4)]  # (the loop's work)
                await asyncio.to_thread(refused_calls, missed)
                for call in busy:
                    call.cancel()
        finally:
            await server.stop(0)
        return missed

    assert asyncio.run(body()) == []
