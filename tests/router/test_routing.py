"""The router in front of two real engines, replicas found through the prefix index: affinity,
spill under load, salts, bad input, the calls it forwards."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from tests.router.stack import (
    BLOCK_SIZE,
    generate,
    generate_call,
    generate_kv_routed,
    hasher_of,
    routed_by,
    served_by,
    wait_until,
)

PREFIX_BLOCKS = 12


def prompt(seed: int, blocks: int = PREFIX_BLOCKS, suffix: int = 5) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(blocks * BLOCK_SIZE + suffix)]


def with_suffix(base: list[int], seed: int, prefix_tokens: int) -> list[int]:
    rng = random.Random(seed)
    return base[:prefix_tokens] + [rng.randrange(100, 40000) for _ in range(7)]


def test_replicas_are_discovered_from_the_index(stack, router_stub):
    # Up is read again until it is: under load one index call can pass the router's lookup
    # deadline, and the router counts the index down until its next call answers (a fresh
    # clone's suite met that, ~0.2 s down, once).
    def index_up() -> dict | None:
        details = router_stub.EngineStats(pb.EngineStatsRequest(), timeout=10).index_details
        return details if details["index_up"] == "true" else None

    details = wait_until(index_up, what="the router's index up")
    assert details["replicas_routable"] == "2"
    for engine_id, engine in stack.engines.items():
        assert details[f"replica.{engine_id}"] == f"{engine.target} up"
    with stack.channel() as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "pagedgen.generation.v1.Generation",
                        "pagedgen.prefix_index.v1.PrefixIndex"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service


def test_a_repeated_prefix_goes_where_it_is_cached(stack, router_stub):
    base = prompt(1)
    first, [holder] = generate(router_stub, base)
    assert first.usage.cached_tokens == 0
    chain = hasher_of(router_stub).chain(base, None)
    wait_until(lambda: stack.lookup(chain).get(holder) == PREFIX_BLOCKS,
               what="the index sees the first request's blocks")
    # Only requests routed by kv-aware show affinity: a Lookup slower than the router's
    # timeout (a starved machine) routes one by the prefix-hash-bounded fallback, whose replica then
    # holds the prefix too.
    holders = {holder}
    for i in range(4):
        reply, replicas, holders = generate_kv_routed(
            router_stub, with_suffix(base, 100 + i, len(chain) * 16), holders)
        assert len(replicas) == 1 and replicas[0] in holders, (
            f"request {i} went to {replicas}, the prefix is on {sorted(holders)}")
        assert reply.usage.cached_tokens == PREFIX_BLOCKS * BLOCK_SIZE


def test_a_burst_for_a_new_prefix_stays_on_one_replica(stack, router_stub):
    """Four requests for a prefix no replica holds, sent at once: the index cannot show the
    first one's blocks before it has been prefilled, but the router credits the replica it
    just sent them to, so the others follow it there (and the prefix is cached once) instead
    of going to the idle replica to prefill it again.

    Only kv-aware's credit is under test: prefix-hash-bounded (its fallback when a Lookup
    times out on a starved machine) keeps a prefix on its rendezvous home too, so a burst
    with a request routed by it proves nothing and is sent again on a fresh prefix."""
    deadline = time.monotonic() + 60
    seed = 7
    while True:
        base = prompt(seed)
        requests = [with_suffix(base, 300 + i, PREFIX_BLOCKS * BLOCK_SIZE) for i in range(4)]
        with ThreadPoolExecutor(4) as pool:
            calls = list(pool.map(lambda ids: generate_call(router_stub, ids, max_tokens=4),
                                  requests))
        routes = [routed_by(call) for _, call in calls]
        if all(r == ["kv-aware"] for r in routes):
            break
        assert all(r and set(r) <= {"kv-aware", "prefix-hash-bounded-fallback"}
                   for r in routes), routes
        assert time.monotonic() < deadline, (
            f"every burst for 60 s had a request routed by the fallback: {routes}")
        seed += 1000
    placed = {served_by(call)[0] for _, call in calls}
    assert len(placed) == 1, [served_by(call) for _, call in calls]


def test_different_salts_are_never_credited_as_shared(stack, router_stub):
    base = prompt(2)
    _, [holder] = generate(router_stub, base, cache_salt="tenant-a")
    hasher = hasher_of(router_stub)
    salted = hasher.chain(base, "tenant-a")
    wait_until(lambda: stack.lookup(salted).get(holder) == PREFIX_BLOCKS,
               what="the salted blocks in the index")
    # Another tenant's chain differs from the first block: the index credits nobody.
    other = hasher.chain(base, "tenant-b")
    assert stack.lookup(other) == {}
    assert stack.lookup(hasher.chain(base, None)) == {}
    for salt in ("tenant-b", ""):
        reply, _ = generate(router_stub, base, cache_salt=salt)
        assert reply.usage.cached_tokens == 0, salt


def hot_burst(stack, router_stub, seed: int) -> tuple[str, list]:
    """A prefix cached on one replica, then eight long requests for it at once: the holder and
    the calls (reply, call) of the burst."""
    base = prompt(seed)
    _, [holder] = generate(router_stub, base)
    chain = hasher_of(router_stub).chain(base, None)
    wait_until(lambda: stack.lookup(chain).get(holder) == PREFIX_BLOCKS,
               what="the index sees the prefix")
    requests = [with_suffix(base, 200 + i, PREFIX_BLOCKS * BLOCK_SIZE) for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        return holder, list(pool.map(lambda ids: generate_call(router_stub, ids, max_tokens=48),
                                     requests))


def test_a_hot_prefix_spills_to_the_other_replica_under_load(stack, router_stub):
    # The bounded-load cap keeps the holder from taking the whole burst. Only a burst routed
    # wholly by kv-aware shows that: one with a request whose Lookup timed out (a starved
    # machine) routed by the prefix-hash-bounded fallback is tried again on a fresh prefix (the
    # fallback's replicas hold this one now).
    deadline = time.monotonic() + 60
    seed = 3
    while True:
        holder, calls = hot_burst(stack, router_stub, seed)
        if all(routed_by(call) == ["kv-aware"] for _, call in calls):
            break
        assert time.monotonic() < deadline, "every burst had a request routed by the fallback"
        seed += 1000
    results = [(reply, served_by(call)) for reply, call in calls]
    placed = [replicas[0] for _, replicas in results]
    assert set(placed) == set(stack.engines), placed
    assert placed.count(holder) >= 3, placed  # the cache still draws its share
    for reply, _ in results:
        assert reply.completions[0].finish_reason == pb.FINISH_REASON_LENGTH


BAD_REQUESTS = [
    ("no input", pb.GenerateRequest()),
    ("top_p", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6]),
                                 sampling=pb.SamplingParams(top_p=1.5))),
    ("vocabulary", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 10**8]))),
    ("context", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 100),
                                   sampling=pb.SamplingParams(max_tokens=5000))),
    ("empty text", pb.GenerateRequest(text="")),
    ("chat role", pb.GenerateRequest(chat=pb.ChatMessages(
        messages=[pb.ChatMessage(role="robot", content="hi")]))),
    ("request id", pb.GenerateRequest(request_id="has spaces", token_ids=pb.TokenIds(ids=[5]))),
]


@pytest.mark.parametrize("name,request_", BAD_REQUESTS, ids=[n for n, _ in BAD_REQUESTS])
def test_bad_input_gets_the_engines_status_and_message(stack, router_stub, name, request_):
    with stack.channel(next(iter(stack.engines.values())).target) as channel:
        with pytest.raises(grpc.RpcError) as direct:
            pb_grpc.GenerationStub(channel).Generate(request_, timeout=10)
    for call in (router_stub.Generate, lambda r, timeout: list(
            router_stub.GenerateStream(r, timeout=timeout))):
        with pytest.raises(grpc.RpcError) as routed:
            call(request_, timeout=10)
        assert routed.value.code() == direct.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert routed.value.details() == direct.value.details()
    reply, _ = generate(router_stub, [5, 6, 7], max_tokens=2)  # still serving
    assert len(reply.completions[0].token_ids) == 2


def test_a_live_request_id_is_refused_and_abort_reaches_the_replica(stack, router_stub):
    request = pb.GenerateRequest(
        request_id="router-abort-1", token_ids=pb.TokenIds(ids=prompt(4)),
        sampling=pb.SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True))
    stream = router_stub.GenerateStream(request, timeout=60)
    first = next(stream)
    assert first.request_id == "router-abort-1"
    with pytest.raises(grpc.RpcError) as duplicate:
        router_stub.Generate(request, timeout=10)
    assert duplicate.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert router_stub.Abort(pb.AbortRequest(request_id="router-abort-1"), timeout=10).found
    last = list(stream)[-1]
    assert last.finished and last.choices[0].finish_reason == pb.FINISH_REASON_ABORT
    assert not router_stub.Abort(pb.AbortRequest(request_id="router-abort-1"), timeout=10).found


def test_cancelling_the_client_call_frees_the_replica(stack, router_stub):
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt(5)),
        sampling=pb.SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True))
    stream = router_stub.GenerateStream(request, timeout=60)
    next(stream)
    stream.cancel()

    def all_idle() -> bool:
        for engine in stack.engines.values():
            with stack.channel(engine.target) as channel:
                stats = pb_grpc.GenerationStub(channel).EngineStats(pb.EngineStatsRequest(),
                                                                    timeout=5)
            if stats.num_live_requests or stats.kv_cache_usage:
                return False
        return True

    wait_until(all_idle, what="every replica idle after the cancel")


def test_deadline_reaches_the_replica(stack, router_stub):
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt(6)),
        sampling=pb.SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True))
    with pytest.raises(grpc.RpcError) as late:
        router_stub.Generate(request, timeout=0.5)
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_forwarded_calls(stack, router_stub):
    info = router_stub.ModelInfo(pb.ModelInfoRequest(), timeout=10)
    assert info.block_size == BLOCK_SIZE and info.engine_id in stack.engines
    ids = router_stub.Tokenize(pb.TokenizeRequest(text="Hello router"), timeout=10).token_ids
    text = router_stub.Detokenize(pb.DetokenizeRequest(token_ids=ids), timeout=10).text
    assert text == "Hello router"
    pinned = router_stub.PinPrefix(pb.PinPrefixRequest(token_ids=pb.TokenIds(ids=prompt(1))),
                                   timeout=10)
    assert pinned.num_blocks == PREFIX_BLOCKS


def test_cumulative_logprobs_reach_the_client_whole(router_stub):
    """The router's Generate gathers a stream: a beam's cumulative logprob and a sampled
    completion's (logprobs asked) reach the client as the stream's last message said them."""
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt(3)), sampling=pb.SamplingParams(
        beam_width=2, n=2, max_tokens=4, ignore_eos=True))
    beams = router_stub.Generate(request, timeout=60).completions
    assert len(beams) == 2 and all(c.HasField("cumulative_logprob") for c in beams)
    assert beams[0].cumulative_logprob != 0
    request.sampling.Clear()
    request.sampling.MergeFrom(pb.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                 logprobs=1))
    [sampled] = router_stub.Generate(request, timeout=60).completions
    assert sampled.cumulative_logprob == pytest.approx(
        sum(lp.logprob for lp in sampled.logprobs), abs=1e-6)
    streamed = [c for m in router_stub.GenerateStream(request, timeout=60) for c in m.choices]
    assert streamed[-1].cumulative_logprob == pytest.approx(sampled.cumulative_logprob, abs=1e-5)


def test_prompt_logprobs_reach_the_client_once(router_stub):
    """Through the router: once in a stream (the first token's message), in the unary reply."""
    ids = prompt(4)
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2))
    unary = router_stub.Generate(request, timeout=60)
    assert [lp.token_id for lp in unary.prompt_logprobs] == ids[1:]
    assert all(len(lp.top) >= 2 and lp.rank >= 1 for lp in unary.prompt_logprobs)
    streamed = [m.prompt_logprobs for m in router_stub.GenerateStream(request, timeout=60)
                if m.prompt_logprobs]
    assert len(streamed) == 1
    assert [lp.token_id for lp in streamed[0]] == ids[1:]
    assert [lp.logprob for lp in streamed[0]] == pytest.approx(
        [lp.logprob for lp in unary.prompt_logprobs], abs=1e-5)


def test_a_request_that_does_not_decode_is_invalid_argument(stack):
    """As at the engine (engine_service/serving/wire_errors.py): a client's bad bytes are its
    error, not UNKNOWN with a traceback in the router's log."""
    good = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=2))
    bad = good.SerializeToString().replace(b"hi", b"\xff\xfe")
    with stack.channel() as channel:
        generate_raw = channel.unary_unary("/pagedgen.generation.v1.Generation/Generate",
                                           request_serializer=lambda b: b,
                                           response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as refused:
            generate_raw(bad, timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "well-formed protobuf message" in refused.value.details()
        reply = pb.GenerateResponse.FromString(generate_raw(good.SerializeToString(),
                                                            timeout=60))
        assert reply.usage.completion_tokens == 2


def test_a_token_prompt_past_the_context_is_cut_when_it_asks(router_stub):
    """truncate_prompt_tokens through the router: a token-id prompt past every replica's
    context, refused as it stands, is cut to its last tokens and runs (-1: to the longest
    the context takes)."""
    info = router_stub.ModelInfo(pb.ModelInfoRequest(), timeout=60)
    ids = [100 + (i * 37) % 30000 for i in range(info.max_model_len + 20)]
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(
        temperature=0, max_tokens=2, ignore_eos=True))
    with pytest.raises(grpc.RpcError) as refused:
        router_stub.Generate(request, timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    request.sampling.truncate_prompt_tokens = 6
    cut = router_stub.Generate(request, timeout=60)
    assert cut.usage.prompt_tokens == 6
    request.token_ids.ids[:] = ids[-6:]
    request.sampling.ClearField("truncate_prompt_tokens")
    assert router_stub.Generate(request, timeout=60).completions[0].token_ids == (
        cut.completions[0].token_ids)
