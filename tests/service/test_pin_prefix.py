"""PinPrefix over gRPC: computed when not cached, pinned at the prefix index, and validated like
everything else."""

from __future__ import annotations

import re

import grpc
import pytest

from pagedgen_api import generation_pb2 as pb

PROMPT = [(i * 37) % 4000 + 100 for i in range(40)]  # 2 full blocks of 16 and a partial one


def test_pin_prefix_pins_the_held_blocks(stub):
    reply = stub.Generate(pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=PROMPT), cache_salt="pin-test",
        sampling=pb.SamplingParams(temperature=0, max_tokens=2)))
    assert reply.usage.completion_tokens == 2
    pinned = stub.PinPrefix(pb.PinPrefixRequest(token_ids=pb.TokenIds(ids=PROMPT),
                                                cache_salt="pin-test", ttl_s=60))
    assert (pinned.num_blocks, pinned.num_pinned) == (2, 2)
    unpinned = stub.PinPrefix(pb.PinPrefixRequest(token_ids=pb.TokenIds(ids=PROMPT),
                                                  cache_salt="pin-test", unpin=True))
    assert unpinned.num_pinned == 2


def test_pin_prefix_computes_a_prefix_nobody_sent(stub):
    """Another salt names other blocks, which this engine never held: PinPrefix computes them
    (a prefill-only request), pins them, and the first request with the prefix finds them
    cached."""
    pinned = stub.PinPrefix(pb.PinPrefixRequest(token_ids=pb.TokenIds(ids=PROMPT),
                                                cache_salt="computed-by-pin", ttl_s=60))
    assert (pinned.num_blocks, pinned.num_pinned) == (2, 2)
    first = stub.Generate(pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=PROMPT), cache_salt="computed-by-pin",
        sampling=pb.SamplingParams(temperature=0, max_tokens=1)))
    assert first.usage.cached_tokens == 32
    stub.PinPrefix(pb.PinPrefixRequest(token_ids=pb.TokenIds(ids=PROMPT),
                                       cache_salt="computed-by-pin", unpin=True))


@pytest.mark.parametrize(("request_", "message"), [
    (pb.PinPrefixRequest(token_ids=pb.TokenIds(ids=PROMPT), ttl_s=-1),
     "ttl_s must be in [0, 2592000] seconds (0 = no TTL), got -1.0"),
    (pb.PinPrefixRequest(token_ids=pb.TokenIds(ids=PROMPT[:10])),
     "prompt must hold at least one full block (16 tokens) to pin, got 10 tokens"),
    (pb.PinPrefixRequest(text=""), "text must be a non-empty string, got ''"),
    (pb.PinPrefixRequest(), "input must be one of text, token_ids or chat, got none of them"),
])
def test_pin_prefix_validation(stub, request_, message):
    with pytest.raises(grpc.RpcError) as caught:
        stub.PinPrefix(request_)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == message


def test_pin_over_the_index_budget_is_resource_exhausted(stub):
    """The index refuses pins past the engine's budget (at most the ceiling, 50% of 240
    blocks = 120): the client hears it, instead of OK with nothing pinned."""
    prompt = [(i * 53) % 4000 + 100 for i in range(130 * 16 + 3)]  # 130 full blocks
    stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), cache_salt="budget",
                                     sampling=pb.SamplingParams(temperature=0, max_tokens=1)))
    with pytest.raises(grpc.RpcError) as caught:
        stub.PinPrefix(pb.PinPrefixRequest(token_ids=pb.TokenIds(ids=prompt),
                                           cache_salt="budget"))
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    budget = re.search(r"pin budget of (\d+)", caught.value.details())
    assert budget is not None and int(budget[1]) <= 120, caught.value.details()
    # The link is fine: a pin within the budget still works right after.
    small = stub.PinPrefix(pb.PinPrefixRequest(token_ids=pb.TokenIds(ids=prompt[:32]),
                                               cache_salt="budget"))
    assert small.num_pinned == 2
    stats = stub.EngineStats(pb.EngineStatsRequest())
    assert not stats.degraded
    # Unpinned, not left to lapse: the engine is the session's, and the next test's count of
    # pinned blocks (test_overlapping_pin_prefix.py) must not drop under it.
    unpinned = stub.PinPrefix(pb.PinPrefixRequest(token_ids=pb.TokenIds(ids=prompt[:32]),
                                                  cache_salt="budget", unpin=True))
    assert unpinned.num_pinned == 2
