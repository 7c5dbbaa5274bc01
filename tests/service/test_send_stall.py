"""A client that opens a GenerateStream and never reads it: once its next message has waited
unsent --send-stall-timeout-s (the client took nothing), the call is ended, its request
stopped, its queue slot and output freed, and the stall counted; when the client reads on it
gets what was sent and then DEADLINE_EXCEEDED naming the flag. A slow reader (a message a
second) is never cut.

Before, the call held its slot (the queue limit counts open calls) and its output for as long
as the client kept its connection, which keepalive pings keep open: a finished, unread stream
refused every later request on a server at its limit."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

import grpc

from engine_service.core.config import EngineConfig
from engine_service.core.engine import LLMEngine
from engine_service.serving.connection_limits import generation_limits
from engine_service.serving.send_stall import SendStallWatch
from engine_service.serving.server import EngineServer, ServerOptions
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from tests.support.frozen_relay import FrozenRelay

STALL_TIMEOUT_S = 1.0
# The client grants its stream no more window than it reads: what it does not read waits here.
SMALL_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024),
                ("grpc.use_local_subchannel_pool", 1)]
# ~60 KB of output (200 tokens, 20 logprobs): far past what the client's window takes.
UNREAD = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]),
                            sampling=pb.SamplingParams(max_tokens=200, ignore_eos=True,
                                                       logprobs=20))
# Long enough to generate for seconds; 5 logprobs: what a reader taking a message a second
# leaves waiting stays under --max-unsent-tokens.
LONG = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]),
                          sampling=pb.SamplingParams(max_tokens=1000, ignore_eos=True,
                                                     logprobs=5, n=16))


async def _until(predicate, what: str, timeout_s: float) -> float:
    """Seconds until `predicate()` held."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"{what}: not reached after {timeout_s}s")
        await asyncio.sleep(0.02)
    return time.monotonic() - started


async def _read_to_its_stall(unread) -> tuple[int, str]:
    """The tokens a stream ended by the watch still delivers, and the details of its end,
    which must be DEADLINE_EXCEEDED naming the flag."""
    received = 0
    try:
        async for message in unread:
            received += sum(len(c.token_ids) for c in message.choices)
    except grpc.aio.AioRpcError as error:
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, error
        assert "--send-stall-timeout-s 1" in error.details(), error.details()
        return received, error.details()
    raise AssertionError("the stream ended OK")


def _serve(tiny_llama_dir, test_certs, body, stall_timeout_s: float = STALL_TIMEOUT_S,
           max_live_requests: int = 1, keepalive_timeout_ms: int | None = None):
    """`keepalive_timeout_ms`: the server's, when not the shipped one."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), num_blocks=1100,
                                    max_model_len=1024))
    connection = None
    if keepalive_timeout_ms is not None:
        connection = replace(generation_limits(engine.max_model_len, max_live_requests),
                             keepalive_timeout_ms=keepalive_timeout_ms)

    async def run():
        server = EngineServer(engine, ServerOptions(
            port=0, max_live_requests=max_live_requests, send_stall_timeout_s=stall_timeout_s,
            tls=test_certs.material("engine"), connection=connection))
        port = await server.start()
        try:
            await body(server, f"127.0.0.1:{port}")
        finally:
            await server.stop(grace_s=0.5)

    asyncio.run(run())


def test_an_unread_stream_is_ended_and_frees_its_slot(tiny_llama_dir, test_certs):
    async def body(server: EngineServer, target: str) -> None:
        servicer = server.servicer
        async with test_certs.aio_channel(target, options=SMALL_WINDOW) as unread_channel, \
                test_certs.aio_channel(target) as channel:
            # (A deadline far past the stall's: a stream left without its end fails here.)
            unread = pb_grpc.GenerationStub(unread_channel).GenerateStream(UNREAD, timeout=60)
            await unread.initial_metadata()
            # Its output is made (the engine is done with it) but not read: the call holds the
            # one slot until the watch ends it.
            await _until(lambda: server.async_engine.num_live == 0, "generated", 60)
            waited = await _until(lambda: servicer.num_open_calls == 0, "the call ended",
                                  STALL_TIMEOUT_S * 5)
            assert servicer.send_stalls.timeout_s == STALL_TIMEOUT_S
            assert server.metrics.send_stalls._value.get() == 1
            assert server.metrics.requests.labels("DEADLINE_EXCEEDED")._value.get() == 1
            # The slot is free: the next request is served, not RESOURCE_EXHAUSTED.
            reply = await pb_grpc.GenerationStub(channel).Generate(
                pb.GenerateRequest(text="Hi", sampling=pb.SamplingParams(max_tokens=2)))
            assert reply.usage.completion_tokens == 2
            # Reading on, the client gets what was sent, then why the call ended.
            received, details = await _read_to_its_stall(unread)
            assert "read the stream as it comes" in details
            assert 0 < received < 200
            assert waited < STALL_TIMEOUT_S * 3

    _serve(tiny_llama_dir, test_certs, body)


def test_an_unread_stream_whose_first_message_is_stuck_gets_its_end(tiny_llama_dir,
                                                                     test_certs):
    """The first message alone is past the client's window (16 choices, 20 logprobs each):
    the write carrying the call's headers is the one that waits. Before, grpc.aio took the
    headers for unsent, ending the call sent them again, gRPC refused that batch
    (GRPC_CALL_ERROR_TOO_MANY_OPERATIONS) and no status went: the client, which had the
    headers, read on until its own deadline."""
    first_too_big = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[1, 2, 3]),
        sampling=pb.SamplingParams(max_tokens=4, ignore_eos=True, logprobs=20, n=16))
    deadline_s = 30.0

    async def body(server: EngineServer, target: str) -> None:
        async with test_certs.aio_channel(target, options=SMALL_WINDOW) as channel:
            unread = pb_grpc.GenerationStub(channel).GenerateStream(first_too_big,
                                                                    timeout=deadline_s)
            await unread.initial_metadata()
            await _until(lambda: server.metrics.send_stalls._value.get() == 1, "the stall",
                         STALL_TIMEOUT_S * 10)
            started = time.monotonic()
            received, _ = await _read_to_its_stall(unread)
            assert received < 16 * 4  # (the stuck message may reach a client reading on)
            assert time.monotonic() - started < deadline_s / 2  # its end, not its deadline

    _serve(tiny_llama_dir, test_certs, body)


def test_a_stream_opened_on_a_connection_that_takes_nothing_is_ended(tiny_llama_dir,
                                                                      test_certs):
    """The client's connection takes no bytes at all (a frozen client): streams already on it
    fill it, and a stream opened after that waits in sending its headers, which queue behind
    them. That wait is watched too: before, the call sat in it unwatched, holding its queue
    slot until keepalive gave up on the connection (80 s at the defaults)."""
    big = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]),
                             sampling=pb.SamplingParams(max_tokens=1000, ignore_eos=True,
                                                        logprobs=20, n=16))
    small = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]),
                               sampling=pb.SamplingParams(max_tokens=20, ignore_eos=True))
    # A large window: the server writes all it can, and the connection, not the stream, is full.
    wide_window = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 256 << 20),
                   ("grpc.use_local_subchannel_pool", 1),
                   ("grpc.ssl_target_name_override", "127.0.0.1")]

    async def body(server: EngineServer, target: str) -> None:
        servicer = server.servicer
        relay = FrozenRelay(int(target.rsplit(":", 1)[1]))
        async with relay.serving() as relayed, \
                test_certs.aio_channel(relayed, options=wide_window) as channel:
            stub = pb_grpc.GenerationStub(channel)
            fillers = [stub.GenerateStream(big, timeout=60) for _ in range(4)]
            for filler in fillers:
                await filler.read()
            relay.frozen.set()
            # The fillers' writes stall and are ended: the connection is full.
            await _until(lambda: server.metrics.send_stalls._value.get() == 4,
                         "the fillers ended", 30)
            late = stub.GenerateStream(small, timeout=60)
            await _until(lambda: servicer.num_open_calls == 1, "the late call admitted", 10)
            waited = await _until(lambda: servicer.num_open_calls == 0, "the late call ended",
                                  STALL_TIMEOUT_S * 10)
            assert server.metrics.send_stalls._value.get() == 5
            assert server.metrics.requests.labels("DEADLINE_EXCEEDED")._value.get() == 5
            await _until(lambda: server.async_engine.num_live == 0, "stopped in the engine", 10)
            assert waited < STALL_TIMEOUT_S * 5
            # The client takes bytes again (a paused VM resumed): the late call gets its end,
            # not its own deadline (its headers went, then the status; before, gRPC refused a
            # status that sent them again).
            relay.frozen.clear()
            started = time.monotonic()
            received, details = await _read_to_its_stall(late)
            assert received == 0 and "read the stream as it comes" in details
            assert time.monotonic() - started < 30
            for call in fillers:
                call.cancel()

    # gRPC sets the server's TCP_USER_TIMEOUT to its keepalive timeout (10 s shipped): the
    # kernel drops a connection whose peer has kept a zero window that long, ending every call
    # on it CANCELLED. That is the frozen client's other way out; on a loaded host the fillers
    # take seconds to fill the connection, and it came first (the late call CANCELLED, not
    # stalled). Here it is put past the test's length, so the watch is what ends the call.
    _serve(tiny_llama_dir, test_certs, body, max_live_requests=5, keepalive_timeout_ms=120_000)


def test_an_unfinished_unread_request_is_stopped(tiny_llama_dir, test_certs, caplog):
    # A request still generating when its client stops reading is aborted in the engine.
    async def body(server: EngineServer, target: str) -> None:
        request = LONG
        async with test_certs.aio_channel(target, options=SMALL_WINDOW) as channel:
            unread = pb_grpc.GenerationStub(channel).GenerateStream(request)
            await unread.initial_metadata()
            await _until(lambda: server.servicer.num_open_calls == 0, "the call ended", 30)
            await _until(lambda: server.async_engine.num_live == 0, "stopped in the engine", 10)
            unread.cancel()
        # The client gone, the status queued for it fails to go: that is no warning.
        await _until(lambda: not server.servicer.send_stalls._tasks, "the watch idle", 10)

    with caplog.at_level(logging.DEBUG, logger="engine_service.serving.send_stall"):
        _serve(tiny_llama_dir, test_certs, body)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "1 stream(s) ended" in warnings[0], warnings


def test_a_slow_reader_is_not_cut(tiny_llama_dir, test_certs):
    # A message a second, each write waiting for the next read (checked: a reader at 1.6
    # timeouts is cut), under a timeout 3 times that: margin for a loaded machine, whose loop
    # (the server's and this client's) may be late.
    timeout_s = 3.0

    async def body(server: EngineServer, target: str) -> None:
        request = LONG
        async with test_certs.aio_channel(target, options=SMALL_WINDOW) as channel:
            call = pb_grpc.GenerationStub(channel).GenerateStream(request)
            started = time.monotonic()
            messages = tokens = 0
            finished = False
            while not finished:
                message = await call.read()
                assert message is not grpc.aio.EOF
                messages += 1
                tokens += sum(len(c.token_ids) for c in message.choices)
                finished = message.finished
                await asyncio.sleep(1.0)
            assert await call.code() == grpc.StatusCode.OK
            assert tokens == 16000
            assert messages > 3 and time.monotonic() - started > timeout_s  # read for longer
            assert server.metrics.send_stalls._value.get() == 0

    _serve(tiny_llama_dir, test_certs, body, stall_timeout_s=timeout_s)


def test_a_write_that_began_after_the_sweep_saw_the_stall_is_not_ended():
    """The sweep saw a write waiting past the timeout; before its end ran, that write went
    through and the next one began. The stream is read: it is watched again, not ended with
    'waited 0 s'."""
    async def run() -> None:
        watch = SendStallWatch(STALL_TIMEOUT_S, "this engine's")
        handler = asyncio.ensure_future(asyncio.sleep(60))
        send = watch.open(None)
        send.task = handler
        send.since = time.monotonic()  # the next write, just begun
        await watch._end(send)
        assert not handler.cancelled() and not send.stalled and send in watch._sends
        watch.close(send)
        handler.cancel()

    asyncio.run(run())
