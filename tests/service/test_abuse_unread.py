"""A client that never reads its streams cannot make the front hold outputs without bound: a
request the engine finished still counts against --max-live-requests until its last message
is sent (servicer.num_live), so past the limit new requests are RESOURCE_EXHAUSTED.

Before, the engine's live count fell back to 0 as each unread request finished, the queue
limit let the next ones in, and the front kept every finished output (measured: +140 MB of
RSS a round of 40 unread streams of 1,000 tokens with 20 logprobs, round after round)."""

from __future__ import annotations

import time

import grpc
import pytest

from engine_service.tools.launch import EngineProcess
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc

MAX_LIVE = 2
# The client grants its streams no more window than it reads: what it does not read stays here.
SMALL_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024),
                ("grpc.use_local_subchannel_pool", 1)]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir, tmp_path_factory, test_certs):
    process = EngineProcess(
        tiny_llama_dir,
        ["--num-blocks", "256", "--block-size", "16", "--max-model-len", "1024",
         "--max-live-requests", str(MAX_LIVE), "--prefix-index", "none",
         "--log-level", "WARNING"],
        log_path=tmp_path_factory.mktemp("abuse_unread") / "engine.log",
        tls=test_certs.files("engine"))
    with process:
        yield process


def _wait(predicate, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not reached after {timeout_s}s")
        time.sleep(0.05)


def test_finished_but_unread_streams_count_against_the_queue_limit(engine, test_certs):
    # ~60 KB of output each (200 tokens, 20 logprobs): far past what the client's window takes.
    unread_request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[1, 2, 3]),
        sampling=pb.SamplingParams(max_tokens=200, ignore_eos=True, logprobs=20))
    with test_certs.channel(engine.target) as reader_channel, \
            test_certs.channel(engine.target, options=SMALL_WINDOW) as unread_channel:
        stub = pb_grpc.GenerationStub(reader_channel)
        unread = [pb_grpc.GenerationStub(unread_channel).GenerateStream(unread_request,
                                                                       timeout=120)
                  for _ in range(MAX_LIVE)]

        def engine_done() -> bool:
            stats = stub.EngineStats(pb.EngineStatsRequest(), timeout=10)
            return stats.num_live_requests == 0 and stats.num_free_blocks == stats.num_blocks

        _wait(lambda: all(c.initial_metadata() is not None for c in unread) and engine_done(),
              "the unread requests finished in the engine")
        small = pb.GenerateRequest(text="Hi", sampling=pb.SamplingParams(max_tokens=2))
        with pytest.raises(grpc.RpcError) as refused:
            stub.Generate(small, timeout=30)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
        assert refused.value.details() == (
            f"live requests must be at most {MAX_LIVE} (the queue limit), got {MAX_LIVE + 1}: "
            f"retry later")
        for call in unread:  # the client goes: the calls close, the room comes back
            call.cancel()
        _wait(lambda: _served(stub, small), "a request served once the unread ones closed")
        assert engine_done()


def _served(stub: pb_grpc.GenerationStub, request: pb.GenerateRequest) -> bool:
    try:
        return stub.Generate(request, timeout=30).usage.completion_tokens == 2
    except grpc.RpcError as error:
        if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise
        return False
