"""A slow engine step is no index outage: a PinPrefix (or a re-registration) waiting for the
engine thread must wait for it, and the late command must not hurt the engine thread.
Found by review: a command that ran after the link gave up raised on the engine thread and
killed it."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_service.core.config import EngineConfig
from engine_service.core.engine import LLMEngine
from engine_service.index.link import IndexLinkOptions, connect_prefix_index
from engine_service.serving.server import EngineServer, ServerOptions
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from prefix_index.tools.launch import IndexProcess
from prefix_index.tools.redis_process import RedisProcess
from tests.service.index_fixtures import wait_until

pytestmark = pytest.mark.timeout(120)
SERVING = health_pb2.HealthCheckResponse.SERVING


def test_pin_during_a_slow_step_waits_and_the_engine_lives(tiny_llama_dir, monkeypatch):
    slow = {"pending": False}
    real_step = LLMEngine.step

    def step(self: LLMEngine):
        if slow["pending"]:
            slow["pending"] = False
            time.sleep(1.5)  # one long step: longer than any RPC deadline of the link
        return real_step(self)

    monkeypatch.setattr(LLMEngine, "step", step)
    with RedisProcess() as redis:
        index = IndexProcess(redis.url, ["--log-level", "WARNING"]).start()
        try:
            engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), block_size=8,
                                            num_blocks=64))
            link = connect_prefix_index(engine, index.target, "slow-step",
                                        IndexLinkOptions(rpc_timeout_s=0.1))
            wait_until(lambda: not link.degraded, 10, "registration", engine=engine)

            async def body():
                server = EngineServer(engine, ServerOptions(port=0), index_link=link)
                port = await server.start()
                try:
                    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                        stub = pb_grpc.GenerationStub(channel)
                        health = health_pb2_grpc.HealthStub(channel)
                        prompt = list(range(100, 133))  # 4 full blocks
                        await stub.Generate(pb.GenerateRequest(
                            token_ids=pb.TokenIds(ids=prompt),
                            sampling=pb.SamplingParams(max_tokens=1)))
                        stream = stub.GenerateStream(pb.GenerateRequest(
                            token_ids=pb.TokenIds(ids=[7] * 20),
                            sampling=pb.SamplingParams(max_tokens=60, ignore_eos=True)))
                        await stream.read()
                        slow["pending"] = True
                        await asyncio.sleep(0.1)  # the engine thread is inside the slow step
                        pinned = await stub.PinPrefix(pb.PinPrefixRequest(
                            token_ids=pb.TokenIds(ids=prompt)))
                        rest = []
                        while (message := await stream.read()) != grpc.aio.EOF:
                            rest.append(message)
                        status = (await health.Check(health_pb2.HealthCheckRequest())).status
                        return pinned, rest[-1], status, server.async_engine.dead
                finally:
                    await server.stop(1.0)

            pinned, last, status, dead = asyncio.run(body())
            assert dead is None
            assert status == SERVING
            assert pinned.num_pinned == 4
            assert last.finished and last.usage.completion_tokens == 60
            assert link.policy.num_pinned_idle == 4  # the mirror has the pin too
            link.close()
        finally:
            index.kill()
