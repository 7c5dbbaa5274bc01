"""A stream still running when the drain's grace (--grace-s) ends gets UNAVAILABLE with a
message that says so, and its request stops in the engine; it got grpc.aio's own "Cancelling
all calls", which says nothing of a drain."""

from __future__ import annotations

import asyncio
import signal

import grpc

from engine_service.tools.launch import EngineProcess
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc


def test_a_stream_past_the_grace_ends_unavailable_saying_why(tiny_llama_dir, tmp_path,
                                                             test_certs):
    engine = EngineProcess(tiny_llama_dir, ["--num-blocks", "4096", "--grace-s", "1",
                                            "--prefix-index", "none"],
                           log_path=tmp_path / "engine.log",
                           tls=test_certs.files("engine")).start()
    try:
        async def body() -> tuple[int, grpc.aio.AioRpcError]:
            async with test_certs.aio_channel(engine.target) as channel:
                stub = pb_grpc.GenerationStub(channel)
                # Far more decode steps than a second of grace holds.
                call = stub.GenerateStream(pb.GenerateRequest(
                    text="Keep going", sampling=pb.SamplingParams(
                        max_tokens=4000, n=16, ignore_eos=True)), timeout=120)
                await call.read()
                engine.proc.send_signal(signal.SIGTERM)
                messages = 1
                try:
                    while await call.read() is not grpc.aio.EOF:
                        messages += 1
                except grpc.aio.AioRpcError as error:
                    return messages, error
                raise AssertionError(f"the stream finished in the grace ({messages} messages)")

        messages, error = asyncio.run(body())
        assert engine.proc.wait(30) == 0
    finally:
        engine.kill()
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error
    assert error.details().startswith("the engine is shutting down: this request was still "
                                      "running when its drain (--grace-s 1) ended"), error
    log = (tmp_path / "engine.log").read_text()
    assert "1 requests still live after 1.0s: cancelling them" in log
