"""A stream its client does not read stops its request with RESOURCE_EXHAUSTED once the output
waiting for it passes the engine's bound (--max-unsent-tokens): 20 unread streams of n = 64
leave the engine's memory bounded (every request aborted, every block back in the pool), and a
client that reads is served meanwhile."""

from __future__ import annotations

import time

import grpc
import pytest

from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from tests.bounds.conftest import NUM_BLOCKS, engine_stats, greedy, wait_until

NUM_UNREAD = 20
N = 64
MAX_TOKENS = 200  # 64 sequences of 13 blocks: four such requests run at once in the pool


def unread_request(i: int) -> pb.GenerateRequest:
    request = greedy(MAX_TOKENS, text=f"Unread stream {i}: count to a thousand.")
    request.sampling.n = N
    request.sampling.temperature = 1.0
    request.sampling.seed = i
    request.sampling.ignore_eos = True
    request.sampling.logprobs = 5  # larger messages: the transport fills in a few steps
    return request


def idle(bounded, target: str) -> bool:
    stats = engine_stats(bounded, target)
    return (stats.num_live_requests == 0 and stats.num_running == 0 and stats.num_waiting == 0
            and stats.num_free_blocks == stats.num_blocks)


@pytest.mark.parametrize("front", ["engine", "router"])
def test_unread_streams_are_stopped_and_their_blocks_freed(bounded, front):
    target = bounded.engine.target if front == "engine" else bounded.router.target
    # No BDP probing: the client's windows stay at HTTP/2's 64 KiB, as any client may keep them
    # (with probing they grow, and more of an unread stream sits in the transport first).
    with bounded.channel(target, options=[("grpc.http2.bdp_probe", 0)]) as channel:
        stub = pb_grpc.GenerationStub(channel)
        # Started, never read: each call's messages fill the transport's window, then wait in
        # the engine's buffer.
        unread = [stub.GenerateStream(unread_request(i), timeout=300) for i in range(NUM_UNREAD)]
        try:
            # A client that reads is served while they sit there.
            reply = stub.Generate(greedy(8, text="A legitimate request."), timeout=120)
            assert reply.completions[0].finish_reason == pb.FINISH_REASON_LENGTH
            assert len(reply.completions[0].token_ids) == 8
            # Every unread request is stopped in the engine and its blocks freed, though no
            # client read or cancelled anything.
            wait_until(lambda: idle(bounded, bounded.engine.target),
                       "every unread request stopped and every block free", timeout_s=240)
            assert engine_stats(bounded, bounded.engine.target).num_blocks == NUM_BLOCKS
            if front == "router":  # nor does the router count them on its replica any more
                wait_until(lambda: bounded.router_in_flight() == 0,
                           "the router's in-flight requests back to 0")
            # Read on now: what had reached the transport, then RESOURCE_EXHAUSTED saying why.
            with pytest.raises(grpc.RpcError) as refused:
                for _ in unread[0]:
                    pass
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "the stream was not read" in refused.value.details()
            assert "--max-unsent-tokens" in refused.value.details()
            assert "1024" in refused.value.details()
        finally:
            for call in unread:
                call.cancel()


@pytest.mark.parametrize("front", ["engine", "router"])
def test_a_slow_reader_gets_its_whole_stream(bounded, front):
    """A client that reads, slowly, is never cut: what piles up between its reads is merged
    into its next message (here 4 sequences x 100 tokens x 6 with logprobs: twice the bound
    in all, a fraction of it between two reads)."""
    target = bounded.engine.target if front == "engine" else bounded.router.target
    request = greedy(100, text="A slow reader.")
    request.sampling.n = 4
    request.sampling.ignore_eos = True
    request.sampling.logprobs = 5
    tokens: dict[int, list[int]] = {}
    finished = set()
    with bounded.channel(target, options=[("grpc.http2.bdp_probe", 0)]) as channel:
        for message in pb_grpc.GenerationStub(channel).GenerateStream(request, timeout=300):
            for choice in message.choices:
                tokens.setdefault(choice.index, []).extend(choice.token_ids)
                assert len(choice.logprobs) == len(choice.token_ids)
                if choice.finish_reason:
                    finished.add(choice.index)
            time.sleep(0.02)
    assert finished == {0, 1, 2, 3}
    assert all(len(ids) == 100 for ids in tokens.values())
