"""Failures behind the router: a replica killed mid-stream (the stream goes on elsewhere,
token-identical), a replica restarted under its id (no credit for blocks it lost), the prefix
index killed (prefix-hash-bounded fallback, said in health) and back (kv-aware again, by itself)."""

from __future__ import annotations

import re
import signal
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
    generate_kv_routed,
    hasher_of,
    served_by,
    wait_until,
)
from tests.router.test_routing import PREFIX_BLOCKS, prompt, with_suffix

MAX_TOKENS = 300


def stream_request(ids: list[int], request_id: str, logprobs: int | None = None,
                   prompt_logprobs: int | None = None) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id, token_ids=pb.TokenIds(ids=ids),
        sampling=pb.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                   logprobs=logprobs, prompt_logprobs=prompt_logprobs))


def busy_engine(stack) -> str:
    for engine_id, engine in stack.engines.items():
        with stack.channel(engine.target) as channel:
            stats = pb_grpc.GenerationStub(channel).EngineStats(pb.EngineStatsRequest(),
                                                                timeout=5)
        if stats.num_live_requests:
            return engine_id
    return ""


def tokens_of(messages) -> list[int]:
    return [t for m in messages for c in m.choices for t in c.token_ids]


def killed_mid_stream(stack, call) -> tuple[list, str]:
    """The stream's messages when the replica running it is killed after 5 tokens (and the
    stream goes on elsewhere), and that replica's id."""
    messages = iter(call)
    received = []
    while len(tokens_of(received)) < 5:
        received.append(next(messages))
    victim = wait_until(lambda: busy_engine(stack), what="the replica running the stream")
    stack.kill_engine(victim)
    return received + list(messages), victim


@pytest.fixture(autouse=True)
def every_engine_up(stack) -> None:
    """Each test starts with both replicas, each dead one restarted at its old port: the test
    before it on this worker (under --dist load, not necessarily the one before it in the
    file) may have killed some."""
    stack.restart_dead_engines()
    stack.wait_routable(len(stack.engines))


def test_a_replica_killed_mid_stream_is_invisible_to_the_client(stack, router_stub):
    ids = prompt(11)
    baseline = [t for m in router_stub.GenerateStream(stream_request(ids, "baseline"),
                                                      timeout=120) for c in m.choices
                for t in c.token_ids]
    assert len(baseline) == MAX_TOKENS
    # With the prompt's logprobs too: the resumed request does not score its longer prompt.
    call = router_stub.GenerateStream(stream_request(ids, "survivor", logprobs=0,
                                                     prompt_logprobs=1), timeout=120)
    tokens: list[int] = []
    logprobs: list[float] = []
    prompt_scores: list[list[int]] = []
    messages = iter(call)
    while len(tokens) < 5:
        message = next(messages)
        tokens += [t for c in message.choices for t in c.token_ids]
        logprobs += [lp.logprob for c in message.choices for lp in c.logprobs]
        if message.prompt_logprobs:
            prompt_scores.append([lp.token_id for lp in message.prompt_logprobs])
    victim = wait_until(lambda: busy_engine(stack), what="the replica running the stream")
    stack.kill_engine(victim)
    last = None
    for message in messages:
        tokens += [t for c in message.choices for t in c.token_ids]
        logprobs += [lp.logprob for c in message.choices for lp in c.logprobs]
        if message.prompt_logprobs:
            prompt_scores.append([lp.token_id for lp in message.prompt_logprobs])
        last = message
    assert last is not None and last.finished
    assert tokens == baseline
    assert prompt_scores == [ids[1:]]
    # The cumulative logprob goes on from where the failed replica's left off.
    assert len(logprobs) == MAX_TOKENS
    assert last.choices[-1].cumulative_logprob == pytest.approx(sum(logprobs), abs=1e-6)
    assert last.choices[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert last.usage.prompt_tokens == len(ids)
    assert last.usage.completion_tokens == MAX_TOKENS
    replicas = served_by(call)
    assert replicas[0] == victim and len(replicas) == 2 and replicas[1] != victim
    # New requests meanwhile: none fails (the dead replica is skipped, or retried elsewhere).
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: generate(router_stub, prompt(20 + i), max_tokens=4),
                                range(8)))
    assert all(len(r.completions[0].token_ids) == 4 for r, _ in results)
    assert all(victim not in replicas for _, replicas in results)


def test_a_cut_prompt_goes_on_with_the_tokens_it_ran(stack, router_stub):
    """truncate_prompt_tokens resumed elsewhere: the new replica runs the prompt the first
    one ran (its last prompt_tokens) and the output so far; cut again with that output after
    it, the prompt lost tokens of its own and the stream went another way."""
    ids = prompt(13)
    request = stream_request(ids, "cut")
    request.sampling.truncate_prompt_tokens = 7

    baseline = list(router_stub.GenerateStream(request, timeout=120))
    assert baseline[-1].usage.prompt_tokens == 7
    alone = stream_request(ids[-7:], "cut-by-hand")
    assert tokens_of(router_stub.GenerateStream(alone, timeout=120)) == tokens_of(baseline)
    request.request_id = "cut-survivor"
    call = router_stub.GenerateStream(request, timeout=120)
    received, victim = killed_mid_stream(stack, call)
    assert served_by(call)[0] == victim and len(served_by(call)) == 2
    assert tokens_of(received) == tokens_of(baseline)
    assert received[-1].usage.prompt_tokens == 7


def test_a_stream_with_bad_words_is_not_resumed_once_it_has_output(stack, router_stub):
    """Its words are read in the output, which restarts on another replica (a word begun
    before the switch could be finished after it): the client is told, by name."""
    request = stream_request(prompt(14), "worded")
    request.sampling.bad_words.append("zzqqxxj")
    call = router_stub.GenerateStream(request, timeout=120)
    messages = iter(call)
    received = 0
    while received < 5:
        received += sum(len(c.token_ids) for c in next(messages).choices)
    stack.kill_engine(wait_until(lambda: busy_engine(stack), what="the replica running it"))
    with pytest.raises(grpc.RpcError) as failed:
        list(messages)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "bad_words cannot be resumed on another replica" in failed.value.details()


def test_a_constrained_stream_goes_on_inside_its_grammar(stack, router_stub):
    """A stream with structured outputs resumed elsewhere: the new replica's grammar starts
    after the output so far (resumed_tokens), so the stream is the uninterrupted one's (a
    grammar started afresh on the output would refuse it, or restart it)."""
    regex = "<[a-z ]{20,}"  # begun afresh, the grammar would make the replica write "<" again
    request = stream_request(prompt(12), "constrained")
    request.sampling.ClearField("ignore_eos")  # refused with a grammar, which ends with EOS
    request.sampling.structured_outputs.regex = regex

    baseline = tokens_of(router_stub.GenerateStream(request, timeout=120))
    assert len(baseline) == MAX_TOKENS  # long enough to be cut: the tiny model rarely ends it
    request.request_id = "constrained-survivor"
    call = router_stub.GenerateStream(request, timeout=120)
    received, victim = killed_mid_stream(stack, call)
    assert tokens_of(received) == baseline
    assert received[-1].finished and served_by(call)[1:] and served_by(call)[0] == victim
    text = "".join(c.text for m in received for c in m.choices)
    assert re.fullmatch("<[a-z ]*", text)


def model_info(stack, target: str) -> pb.ModelInfoResponse:
    with stack.channel(target) as channel:
        return pb_grpc.GenerationStub(channel).ModelInfo(pb.ModelInfoRequest(), timeout=10)


def test_a_replica_restarted_under_its_id_gets_no_stale_credit(stack, router_stub):
    # Its own victim, whatever ran before: a replica that cached the prompt, then killed; the
    # prompt then runs (and is cached) on the survivor.
    ids = prompt(13)
    _, [victim] = generate(router_stub, ids)
    chain = hasher_of(router_stub).chain(ids, None)
    wait_until(lambda: stack.lookup(chain).get(victim) == PREFIX_BLOCKS,
               what="the victim's copy of the prefix in the index")
    stack.kill_engine(victim)
    wait_until(lambda: not router_details(router_stub).get(f"replica.{victim}", "").endswith(
        " up"), what="the router seeing the victim down")
    _, [survivor] = generate(router_stub, ids)
    assert survivor != victim
    # At its old address too, so the router may see it as the same replica come back: only
    # its new instance_id tells the two processes apart.
    restarted = stack.start_engine(victim, port=stack.engines[victim].port)
    stack.wait_routable(2)
    ours = model_info(stack, restarted.target)
    theirs = model_info(stack, stack.engines[survivor].target)
    assert ours.engine_id == victim and ours.instance_id
    assert ours.instance_id != theirs.instance_id  # one per process
    assert model_info(stack, restarted.target).instance_id == ours.instance_id  # and stable in it
    chain = hasher_of(router_stub).chain(ids, None)
    wait_until(lambda: stack.lookup(chain).get(survivor, 0) >= PREFIX_BLOCKS,
               what="the survivor's copy of the prefix in the index")
    assert victim not in stack.lookup(chain)
    # (A request routed by the prefix-hash-bounded fallback, after a Lookup slower than the router's
    # timeout, is sent again; its replica holds the prefix from then on.)
    holders = {survivor}
    for i in range(3):
        reply, replicas, holders = generate_kv_routed(
            router_stub, with_suffix(ids, 300 + i, len(chain) * 16), holders)
        assert len(replicas) == 1 and replicas[0] in holders, (replicas, holders)
        assert reply.usage.cached_tokens >= PREFIX_BLOCKS * BLOCK_SIZE


def test_a_replica_that_hangs_mid_stream_is_left_behind(stack, router_stub):
    """SIGSTOP: the process is alive and its sockets open, but nothing answers. The router
    finds it down (its stats poll times out) and moves the silent stream elsewhere."""
    ids = prompt(12)
    baseline = [t for m in router_stub.GenerateStream(stream_request(ids, "hang-baseline"),
                                                      timeout=120) for c in m.choices
                for t in c.token_ids]
    call = router_stub.GenerateStream(stream_request(ids, "hang-survivor"), timeout=120)
    messages = iter(call)
    tokens = [t for c in next(messages).choices for t in c.token_ids]
    victim = wait_until(lambda: busy_engine(stack), what="the replica running the stream")
    process = stack.engines[victim].proc
    process.send_signal(signal.SIGSTOP)
    try:
        for message in messages:
            tokens += [t for c in message.choices for t in c.token_ids]
    finally:
        process.send_signal(signal.SIGCONT)
    assert tokens == baseline
    replicas = served_by(call)
    assert replicas[0] == victim and replicas[-1] != victim
    stack.wait_routable(2)


def index_health(stack) -> int:
    with stack.channel() as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="pagedgen.prefix_index.v1.PrefixIndex"),
            timeout=5).status


def router_details(router_stub) -> dict[str, str]:
    return dict(router_stub.EngineStats(pb.EngineStatsRequest(), timeout=10).index_details)


def test_index_down_falls_back_then_recovers_by_itself(stack, router_stub):
    # Routes read the router's copy of the index's residency view while its watch holds.
    wait_until(lambda: router_details(router_stub)["index_residency"] == "synced",
               what="the router's residency copy synced")
    port = stack.index.port
    stack.index.kill()
    details = wait_until(
        lambda: (d := router_details(router_stub))["index_up"] == "false" and d,
        what="the router noticing")
    assert details["routing"].startswith("prefix-hash-bounded")
    assert details["index_residency"] == "lookup"  # the watch died with the index
    wait_until(lambda: index_health(stack) == health_pb2.HealthCheckResponse.NOT_SERVING,
               what="health saying the index is down")
    # Still serving, and prefix-hash-bounded keeps one prefix on one replica.
    base = prompt(40)
    placed = {generate(router_stub, with_suffix(base, i, 160))[1][0] for i in range(4)}
    assert len(placed) == 1
    # Back on the same port: the router routes by the index again without being told.
    stack.restart_index(port)  # the stack stops it (a bare start() outlived the test)
    wait_until(lambda: index_health(stack) == health_pb2.HealthCheckResponse.SERVING,
               timeout_s=20, what="the router seeing the index again")
    # The engines re-register and re-sync (each link out of degraded mode); then affinity
    # works from the index again.
    def engines_linked() -> bool:
        for engine in stack.engines.values():
            with stack.channel(engine.target) as channel:
                stats = pb_grpc.GenerationStub(channel).EngineStats(pb.EngineStatsRequest(),
                                                                    timeout=5)
            if stats.degraded:
                return False
        return True

    wait_until(engines_linked, timeout_s=20, what="every engine linked to the index again")
    wait_until(lambda: router_details(router_stub)["index_residency"] == "synced",
               timeout_s=20, what="the router watching the index's residency again")
    fresh = prompt(41)
    chain = hasher_of(router_stub).chain(fresh, None)
    deadline = time.monotonic() + 20
    while True:
        _, [holder] = generate(router_stub, fresh, max_tokens=2)
        if stack.lookup(chain).get(holder) == PREFIX_BLOCKS:
            break
        assert time.monotonic() < deadline, "the index never saw the engines again"
        time.sleep(0.2)
    # Retried while the router answers by the fallback (a Lookup slower than its timeout on a
    # loaded machine marks the index down until the next probe): affinity is kv-aware's.
    reply, replicas, holders = generate_kv_routed(
        router_stub, with_suffix(fresh, 9, len(chain) * 16), {holder})
    assert len(replicas) == 1 and replicas[0] in holders, (replicas, holders)
    assert reply.usage.cached_tokens == PREFIX_BLOCKS * BLOCK_SIZE


def test_every_replica_gone_is_unavailable_with_a_reason(stack, router_stub):
    for engine_id in list(stack.engines):
        stack.kill_engine(engine_id)
    wait_until(lambda: router_stub.EngineStats(pb.EngineStatsRequest(), timeout=10)
               .index_details["replicas_routable"] == "0", what="no routable replica")
    try:
        router_stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6])), timeout=10)
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert "no engine replica can take the request" in error.details()
    else:
        raise AssertionError("a request with no replica up was served")

    def overall_health() -> int:
        with stack.channel() as channel:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                             timeout=5).status

    wait_until(lambda: overall_health() == health_pb2.HealthCheckResponse.NOT_SERVING,
               what="health NOT_SERVING with no replica")
