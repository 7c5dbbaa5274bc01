"""In-process EngineServer: past --max-live-requests a request is RESOURCE_EXHAUSTED, and the
limit frees up as requests finish."""

from __future__ import annotations

import asyncio

import grpc

from engine_service.core.config import EngineConfig
from engine_service.core.engine import LLMEngine
from engine_service.serving.server import EngineServer, ServerOptions
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc


def test_live_request_limit_is_resource_exhausted(tiny_llama_dir, test_certs):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), num_blocks=64))

    async def body():
        server = EngineServer(engine, ServerOptions(port=0, max_live_requests=2,
                                                    tls=test_certs.material("engine")))
        port = await server.start()
        try:
            async with test_certs.aio_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.GenerationStub(channel)
                long = pb.SamplingParams(max_tokens=500, ignore_eos=True)
                calls = [stub.GenerateStream(pb.GenerateRequest(text=f"live {i}", sampling=long))
                         for i in range(2)]
                for call in calls:
                    await call.read()
                try:
                    await stub.Generate(pb.GenerateRequest(text="one too many"))
                    refused = None
                except grpc.aio.AioRpcError as error:
                    refused = (error.code(), error.details())
                for call in calls:
                    call.cancel()
                while server.async_engine.num_live:
                    await asyncio.sleep(0.01)
                after = await stub.Generate(pb.GenerateRequest(
                    text="room again", sampling=pb.SamplingParams(max_tokens=3, ignore_eos=True)))
                return refused, after
        finally:
            await server.stop(1.0)

    refused, after = asyncio.run(body())
    assert refused == (grpc.StatusCode.RESOURCE_EXHAUSTED,
                       "live requests must be at most 2 (the queue limit), got 3: retry later")
    assert after.usage.completion_tokens == 3
    assert engine.check_block_invariants() == []  # the cancelled ones gave every block back
