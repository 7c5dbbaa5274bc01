"""Client cancellation, deadlines and Abort end a request in the engine and free its blocks."""

from __future__ import annotations

import asyncio
import time

import grpc

from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc

# Long enough that it is still running when the test acts: ~190 blocks once done, far more
# steps than the test waits for.
LONG = pb.SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True)


def wait_all_free(stub, timeout_s: float = 30.0) -> pb.EngineStatsResponse:
    """Every block back in the pool with nothing live: a condition, with a deadline generous
    enough for a loaded 2-core machine (the engine gets nothing else to do meanwhile)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = stub.EngineStats(pb.EngineStatsRequest(), timeout=5)
        idle = stats.num_running == 0 and stats.num_waiting == 0 and stats.num_live_requests == 0
        if idle and stats.num_free_blocks == stats.num_blocks:
            return stats
        assert time.monotonic() < deadline, f"blocks not freed: {stats}"
        time.sleep(0.02)


def test_cancel_mid_stream_frees_the_blocks(engine_server, stub):
    async def body():
        async with engine_server.aio_channel() as channel:
            call = pb_grpc.GenerationStub(channel).GenerateStream(
                pb.GenerateRequest(text="Cancel me after a few tokens", sampling=LONG),
                timeout=120)
            for _ in range(5):
                message = await call.read()
                assert not message.finished
            busy = stub.EngineStats(pb.EngineStatsRequest())
            call.cancel()
            return busy, await call.code()

    busy, code = asyncio.run(body())
    assert code == grpc.StatusCode.CANCELLED
    assert busy.num_running == 1 and busy.num_free_blocks < busy.num_blocks
    wait_all_free(stub)


def test_deadline_aborts_and_frees_the_blocks(stub):
    started = time.monotonic()
    try:
        stub.Generate(pb.GenerateRequest(text="Run past my deadline", sampling=LONG), timeout=0.5)
        raise AssertionError("a 3000-token request finished within 0.5 s")
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 3.0
    wait_all_free(stub)


def test_abort_ends_the_stream_with_finish_reason_abort(engine_server, stub):
    async def body():
        async with engine_server.aio_channel() as channel:
            astub = pb_grpc.GenerationStub(channel)
            call = astub.GenerateStream(pb.GenerateRequest(
                request_id="abort-me", text="Abort me", sampling=LONG), timeout=120)
            await call.read()
            found = await astub.Abort(pb.AbortRequest(request_id="abort-me"))
            messages = []
            while (message := await call.read()) is not grpc.aio.EOF:
                messages.append(message)
            return found, messages, await call.code()

    found, messages, code = asyncio.run(body())
    assert found.found and code == grpc.StatusCode.OK
    assert messages[-1].finished
    assert [c.finish_reason for c in messages[-1].choices] == [pb.FINISH_REASON_ABORT]
    assert messages[-1].usage.completion_tokens < 3000
    assert not stub.Abort(pb.AbortRequest(request_id="abort-me")).found
    wait_all_free(stub)


# Beam search streams nothing before its end: the tests watch the engine's stats instead.
BEAM = pb.SamplingParams(beam_width=4, n=2, max_tokens=400, ignore_eos=True)


def wait_beams_running(stub, timeout_s: float = 30.0) -> pb.EngineStatsResponse:
    """Stats once the beam request has forked its beams and taken a few steps."""
    deadline = time.monotonic() + timeout_s
    start = stub.EngineStats(pb.EngineStatsRequest()).num_steps
    while True:
        stats = stub.EngineStats(pb.EngineStatsRequest(), timeout=5)
        if stats.num_running > 0 and stats.num_steps >= start + 5:
            return stats
        assert time.monotonic() < deadline, f"beam search did not start: {stats}"
        time.sleep(0.01)


def test_cancel_mid_beam_search_frees_every_block(engine_server, stub):
    async def body():
        async with engine_server.aio_channel() as channel:
            call = pb_grpc.GenerationStub(channel).GenerateStream(
                pb.GenerateRequest(text="Cancel my beams", sampling=BEAM), timeout=120)
            busy = await asyncio.to_thread(wait_beams_running, stub)
            call.cancel()
            return busy, await call.code()

    busy, code = asyncio.run(body())
    assert code == grpc.StatusCode.CANCELLED
    assert busy.num_free_blocks < busy.num_blocks
    wait_all_free(stub)


def test_abort_mid_beam_search_answers_the_best_running_beams(engine_server, stub):
    async def body():
        async with engine_server.aio_channel() as channel:
            astub = pb_grpc.GenerationStub(channel)
            call = astub.GenerateStream(pb.GenerateRequest(
                request_id="abort-beams", text="Abort my beams", sampling=BEAM), timeout=120)
            await asyncio.to_thread(wait_beams_running, stub)
            found = await astub.Abort(pb.AbortRequest(request_id="abort-beams"))
            messages = []
            while (message := await call.read()) is not grpc.aio.EOF:
                messages.append(message)
            return found, messages, await call.code()

    found, messages, code = asyncio.run(body())
    assert found.found and code == grpc.StatusCode.OK
    [message] = messages  # one message, the last
    assert message.finished
    assert [c.finish_reason for c in message.choices] == [pb.FINISH_REASON_ABORT] * 2
    assert all(0 < len(c.token_ids) < 400 for c in message.choices)
    wait_all_free(stub)
