"""The router's drain: a stream still running when --grace-s ends gets UNAVAILABLE saying so
(it got grpc.aio's own "Cancelling all calls"), and its replica stops the request (the
router's upstream call is cancelled), so the replica's blocks are free again."""

from __future__ import annotations

import asyncio

import grpc

from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from tests.router.stack import RouterStack, wait_until
from tests.support.drain_cut import stream_until_cut


def test_a_routed_stream_past_the_grace_ends_unavailable_saying_why(tiny_llama_dir, tmp_path,
                                                                    test_certs):
    with RouterStack(tiny_llama_dir, tmp_path, test_certs, num_engines=1, with_index=False,
                     router_args=["--grace-s", "1"],
                     engine_shape=["--num-blocks", "4096", "--dtype", "float32"]) as stack:
        router = stack.router

        async def body() -> tuple[int, grpc.aio.AioRpcError]:
            async with stack.certs.aio_end_client_channel(router.target) as channel:
                return await stream_until_cut(channel, router.proc)

        messages, error = asyncio.run(body())
        assert router.proc.wait(30) == 0
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error
        assert error.details().startswith("the router is shutting down: this request was "
                                          "still running when its drain (--grace-s 1) "
                                          "ended"), error
        assert "1 requests still live after 1.0s: cancelling them" in stack.router_log()
        # The replica stopped it: nothing runs there now (its pool is free again).
        engine = next(iter(stack.engines.values()))
        with stack.channel(engine.target) as channel:
            engine_stub = pb_grpc.GenerationStub(channel)

            def idle() -> bool:
                stats = engine_stub.EngineStats(pb.EngineStatsRequest(), timeout=10)
                return stats.num_running == 0 and stats.num_live_requests == 0

            wait_until(idle, timeout_s=10, what="the replica to stop the cut request")
