"""A stream still running when the drain's grace (--grace-s) ends gets UNAVAILABLE with a
message that says so, and its request stops in the engine; it got grpc.aio's own "Cancelling
all calls", which says nothing of a drain."""

from __future__ import annotations

import asyncio

import grpc

from engine_service.tools.launch import EngineProcess
from tests.support.drain_cut import stream_until_cut


def test_a_stream_past_the_grace_ends_unavailable_saying_why(tiny_llama_dir, tmp_path,
                                                             test_certs):
    engine = EngineProcess(tiny_llama_dir, ["--num-blocks", "4096", "--grace-s", "1",
                                            "--prefix-index", "none"],
                           log_path=tmp_path / "engine.log",
                           tls=test_certs.files("engine")).start()
    try:
        async def body() -> tuple[int, grpc.aio.AioRpcError]:
            async with test_certs.aio_channel(engine.target) as channel:
                return await stream_until_cut(channel, engine.proc)

        messages, error = asyncio.run(body())
        assert engine.proc.wait(30) == 0
    finally:
        engine.kill()
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error
    assert error.details().startswith("the engine is shutting down: this request was still "
                                      "running when its drain (--grace-s 1) ended"), error
    log = (tmp_path / "engine.log").read_text()
    assert "1 requests still live after 1.0s: cancelling them" in log
