"""A long stream, its server sent SIGTERM once it streams: what the drain's end does to it."""

from __future__ import annotations

import signal
import subprocess

import grpc

from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc


async def stream_until_cut(channel: grpc.aio.Channel, server: subprocess.Popen
                           ) -> tuple[int, grpc.aio.AioRpcError]:
    """Starts a stream of far more decode steps than a second of grace holds, sends `server`
    SIGTERM after its first message, and reads on until the stream fails; the messages read
    and the error (AssertionError when it finished instead)."""
    call = pb_grpc.GenerationStub(channel).GenerateStream(pb.GenerateRequest(
        text="Keep going", sampling=pb.SamplingParams(max_tokens=4000, n=16, ignore_eos=True)),
        timeout=120)
    await call.read()
    server.send_signal(signal.SIGTERM)
    messages = 1
    try:
        while await call.read() is not grpc.aio.EOF:
            messages += 1
    except grpc.aio.AioRpcError as error:
        return messages, error
    raise AssertionError(f"the stream finished in the grace ({messages} messages)")
