"""Every replica at its request limit: the router answers RESOURCE_EXHAUSTED (429 over HTTP),
a signal to back off and retry, not UNAVAILABLE (503), which says the service is down."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import openai
import pytest

from engine_service.tools.launch import EngineProcess
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from prefix_index.tools.redis_process import free_port
from router.tools.launch import RouterProcess
from tests.support.tls import SessionCerts

LONG = pb.SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True)


@pytest.fixture(scope="module")
def full_stack(tiny_llama_dir, tmp_path_factory, test_certs):
    logs = tmp_path_factory.mktemp("queue_full")
    engines = [EngineProcess(tiny_llama_dir, ["--prefix-index", "none", "--dtype", "float32",
                                              "--max-live-requests", "1"],
                             log_path=logs / f"engine-{i}.log", tls=test_certs.files("engine"))
               for i in range(2)]
    with contextlib.ExitStack() as stack:
        for engine in engines:
            stack.enter_context(engine.start())
        http_port = free_port()
        router = RouterProcess(["--engines", ",".join(e.target for e in engines),
                                "--prefix-index", "none", "--http-port", str(http_port)],
                               log_path=logs / "router.log", tls=test_certs.files("router"))
        stack.enter_context(router.start())
        yield engines, router, http_port


def test_every_replica_full_is_resource_exhausted(full_stack, test_certs):
    engines, router, http_port = full_stack

    async def body():
        channels = [test_certs.aio_channel(e.target) for e in engines]
        # One live request on each replica, straight to it: each is at its limit of one.
        holds = [pb_grpc.GenerationStub(c).GenerateStream(
            pb.GenerateRequest(text="Hold the only slot", sampling=LONG), timeout=120)
            for c in channels]
        for hold in holds:
            await hold.read()
        try:
            async with test_certs.aio_end_client_channel(router.target) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(
                        text="One more", sampling=pb.SamplingParams(max_tokens=4)), timeout=60)
            client = test_certs.async_openai_client(f"https://127.0.0.1:{http_port}/v1", "none",
                                                    max_retries=0)
            with pytest.raises(openai.RateLimitError) as limited:
                await client.completions.create(model=_model_name(engines[0], test_certs),
                                                prompt="One more", max_tokens=4)
            await client.close()
            return refused.value, limited.value
        finally:
            for hold in holds:
                hold.cancel()
            for c in channels:
                await c.close()

    refused, limited = asyncio.run(body())
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused
    assert "request limit" in refused.details()
    assert limited.status_code == 429


def _model_name(engine: EngineProcess, certs: SessionCerts) -> str:
    with certs.channel(engine.target) as channel:
        return pb_grpc.GenerationStub(channel).ModelInfo(pb.ModelInfoRequest(),
                                                         timeout=30).served_model_name
