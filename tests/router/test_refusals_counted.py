"""pagedgen_router_requests_total{code} (and requests_failed) count the generation requests
refused before they reach the servicer, once each, by the code the client got: no key or a
wrong key (the key check, UNAUTHENTICATED), bytes that are not a GenerateRequest (INVALID_ARGUMENT,
wire_errors.py). They were not counted, so a flood of them left no trace in the error ratio.
A tenant's refusal in the servicer (PERMISSION_DENIED) is counted as before. The engine counts
the same refusals the same way (pagedgen_engine_requests_total and requests_rejected).

Routers and an engine in this process, each with a key file, called over loopback; nothing is
routed, so the router's replica need not be up."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from engine_service.core.config import EngineConfig
from engine_service.core.engine import LLMEngine
from engine_service.serving.server import EngineServer, ServerOptions
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from router.config import RouterConfig
from router.core import Router
from router.server import RouterServer
from tenancy.door import TenantDoor
from tenancy.gate import Gate
from tenancy.keyring import KeyRing
from tenancy.keys import KeyTable, Tenant, hash_key

GOOD_KEY, PLAIN_KEY = "operator-key", "tenant-key"
SERVICE = "/pagedgen.generation.v1.Generation/"
GARBAGE = b"\xff\xff\xff\xff"  # not a protobuf message
CODES = ("OK", "UNAUTHENTICATED", "INVALID_ARGUMENT", "PERMISSION_DENIED")


def keyed_door() -> TenantDoor:
    table = KeyTable({hash_key(GOOD_KEY): Tenant("operator", may_set_priority=True),
                      hash_key(PLAIN_KEY): Tenant("plain")})
    return TenantDoor(Gate(KeyRing(table)), b"s" * 32)


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def request(priority: int = 0) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7]), priority=priority,
                              sampling=pb.SamplingParams(max_tokens=2))


async def refused_code(call, *args, **kwargs) -> str:
    try:
        reply = call(*args, timeout=30, **kwargs)
        if hasattr(reply, "read"):  # a stream: its first read says how it ended
            await reply.read()
        else:
            await reply
    except grpc.aio.AioRpcError as error:
        return error.code().name
    raise AssertionError("the call was not refused")


async def refuse_each_way(target: str) -> None:
    """For Generate and GenerateStream: keyless, a wrong key, garbage bytes with a good key,
    garbage bytes with no key (UNAUTHENTICATED: the key check comes first), priority from a
    tenant not allowed it. Each asserted to be refused with its code."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        for method in ("Generate", "GenerateStream"):
            typed = getattr(stub, method)
            kind = channel.unary_stream if method == "GenerateStream" else channel.unary_unary
            raw = kind(SERVICE + method)  # (no serializer: bytes as they are)
            assert await refused_code(typed, request()) == "UNAUTHENTICATED"
            assert await refused_code(typed, request(), metadata=bearer("wrong")) == \
                "UNAUTHENTICATED"
            assert await refused_code(raw, GARBAGE, metadata=bearer(GOOD_KEY)) == \
                "INVALID_ARGUMENT"
            assert await refused_code(raw, GARBAGE) == "UNAUTHENTICATED"
            assert await refused_code(typed, request(priority=1), metadata=bearer(PLAIN_KEY)) \
                == "PERMISSION_DENIED"
        # Not generation requests: refused, and not counted among them.
        assert await refused_code(stub.Tokenize, pb.TokenizeRequest(text="hi")) == \
            "UNAUTHENTICATED"
    await asyncio.sleep(0.2)  # (nothing more may be counted after the calls ended)


EXPECTED = {"OK": 0, "UNAUTHENTICATED": 6, "INVALID_ARGUMENT": 2, "PERMISSION_DENIED": 2}


def test_the_router_counts_each_refusal_once_by_its_code():
    async def body() -> tuple[dict[str, float], dict[str, float]]:
        router = Router(RouterConfig(), ["127.0.0.1:1"], None)
        server = RouterServer(router, port=0, door=keyed_door())
        await server.start()

        def count(metric: str, code: str) -> float:
            return router.metrics.registry.get_sample_value(
                f"pagedgen_router_{metric}_total", {"code": code}) or 0.0

        try:
            await refuse_each_way(f"127.0.0.1:{server.port}")
            return ({code: count("requests", code) for code in CODES},
                    {code: count("requests_failed", code) for code in CODES})
        finally:
            await server.stop(0)

    requests, failed = asyncio.run(body())
    assert requests == EXPECTED
    assert failed == EXPECTED


@pytest.fixture(scope="module")
def engine(tiny_llama_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_llama_dir), num_blocks=64))


def test_the_engine_counts_the_same_refusals_the_same_way(engine):
    async def body() -> tuple[dict[str, float], dict[str, float]]:
        server = EngineServer(engine, ServerOptions(port=0, door=keyed_door()))
        port = await server.start()

        def count(metric: str, code: str) -> float:
            return server.metrics.registry.get_sample_value(
                f"pagedgen_engine_{metric}_total", {"code": code}) or 0.0

        try:
            await refuse_each_way(f"127.0.0.1:{port}")
            return ({code: count("requests", code) for code in CODES},
                    {code: count("requests_rejected", code) for code in CODES})
        finally:
            await server.stop(0)

    requests, rejected = asyncio.run(body())
    assert requests == EXPECTED
    assert rejected == EXPECTED
