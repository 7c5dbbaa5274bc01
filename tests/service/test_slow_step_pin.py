"""A slow engine step is no index outage: a PinPrefix (or a re-registration) waiting for the
engine thread must wait for it, and the late command must not hurt the engine thread.
Found by review: a command that ran after the link gave up raised on the engine thread and
killed it."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_service.core.config import EngineConfig
from engine_service.core.engine import LLMEngine
from engine_service.index.link import connect_prefix_index
from engine_service.serving.server import EngineServer, ServerOptions
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from prefix_index.tools.launch import IndexProcess
from prefix_index.tools.redis_process import RedisProcess
from tests.service.index_fixtures import index_stats, link_options, wait_until
from trust.identity import ENGINE_ROLE

pytestmark = pytest.mark.timeout(120)
SERVING = health_pb2.HealthCheckResponse.SERVING


RPC_TIMEOUT_S = 0.5  # the link's deadline for every call
ENGINE_ID = "slow-step"


def test_pin_during_a_slow_step_waits_and_the_engine_lives(tiny_llama_dir, monkeypatch, test_certs):
    slow = threading.Event()  # set: the next step is the slow one
    inside = threading.Event()  # the engine thread is in the slow step
    index_pinned = threading.Event()  # ... and saw the index hold the pin meanwhile
    real_step = LLMEngine.step
    index_target = ""

    def step(self: LLMEngine):
        if slow.is_set():
            slow.clear()
            inside.set()
            # The pin reaches the index without the engine thread; then the link waits for
            # this thread to put it in the mirror. The step lasts five of the link's deadlines
            # more (a starved machine only makes the link wait longer).
            wait_until(lambda: (s := index_stats(test_certs, index_target, ENGINE_ID)) is not None
                       and s.pinned >= 4, 30, "the pin at the index during the slow step")
            index_pinned.set()
            time.sleep(5 * RPC_TIMEOUT_S)
        return real_step(self)

    monkeypatch.setattr(LLMEngine, "step", step)
    with RedisProcess() as redis:
        index = IndexProcess(redis.url, ["--log-level", "WARNING"],
                             tls=test_certs.files("index")).start()
        index_target = index.target
        try:
            engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), block_size=8,
                                            num_blocks=64))
            link = connect_prefix_index(engine, index.target, ENGINE_ID,
                                        link_options(test_certs, rpc_timeout_s=RPC_TIMEOUT_S))
            wait_until(lambda: not link.degraded, 30, "registration", engine=engine)

            async def body():
                server = EngineServer(engine, ServerOptions(
                    port=0, tls=test_certs.material(ENGINE_ROLE)), index_link=link)
                port = await server.start()
                try:
                    async with test_certs.aio_channel(f"127.0.0.1:{port}",
                                                      peer_role=ENGINE_ROLE) as channel:
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
                        slow.set()
                        assert await asyncio.to_thread(inside.wait, 30), "no slow step"
                        pinned = await stub.PinPrefix(pb.PinPrefixRequest(
                            token_ids=pb.TokenIds(ids=prompt)))
                        assert index_pinned.is_set()  # it waited for the slow step
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
