"""The text of a stream resumed on another replica: the engine holds back text that may be the
start of a stop string; when its replica is killed the router writes that text itself, so the
client's concatenated text (and its tokens) equal an uninterrupted run's."""

from __future__ import annotations

import random

import pytest

from pagedgen_api import generation_pb2 as pb
from tests.router.stack import served_by, wait_until
from tests.router.test_failover import busy_engine

MAX_TOKENS = 200


def request(stop: list[str]) -> pb.GenerateRequest:
    rng = random.Random(5)
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[rng.randrange(100, 4000) for _ in range(40)]),
        sampling=pb.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                   stop=stop))


def gathered(messages) -> tuple[str, list[int], pb.Completion]:
    text, tokens, last = [], [], None
    for message in messages:
        for choice in message.choices:
            text.append(choice.text)
            tokens += choice.token_ids
            last = choice
    return "".join(text), tokens, last


@pytest.fixture(scope="module")
def uninterrupted(stack, router_stub) -> tuple[str, list[int]]:
    # A stop string that began before the switch is caught only by the router's own
    # detokenizer: wait for its local tokenizer (loading it took up to ~15 s with both cores
    # busy, and a switch before then took the Detokenize path: a flaky failure).
    wait_until(lambda: stack.router_stats().index_details.get("tokenizer") == "local",
               timeout_s=60, what="the router's local tokenizer")
    text, tokens, _ = gathered(router_stub.GenerateStream(request([]), timeout=120))
    assert len(tokens) == MAX_TOKENS and len(text) > 260
    return text, tokens


# Stop strings (from the uninterrupted text T) that hold text back from char 10 on: one that
# never matches (it ends in a character T lacks), one that matches across the switch (it began
# before the first replica was killed and ends after); and none at all.
STOPS = {"held, never matches": lambda t: [t[10:250] + "\x01"],
         "matches across the switch": lambda t: [t[10:250]],
         "none": lambda t: []}


@pytest.mark.parametrize("case", list(STOPS))
def test_text_held_back_reaches_the_client_when_its_replica_dies(stack, router_stub,
                                                                 uninterrupted, case):
    stop = STOPS[case](uninterrupted[0])
    calm_text, calm_tokens, calm_last = gathered(
        router_stub.GenerateStream(request(stop), timeout=120))
    call = router_stub.GenerateStream(request(stop), timeout=120)
    messages = iter(call)
    text_before, tokens = "", []
    while len(tokens) < 5:
        first, first_tokens, _ = gathered([next(messages)])
        text_before += first
        tokens += first_tokens
    victim = wait_until(lambda: busy_engine(stack), what="the replica running the stream")
    stack.kill_engine(victim)
    try:
        text, rest, last = gathered(messages)
        replicas = served_by(call)
        assert replicas[0] == victim and len(replicas) == 2, replicas
        assert text_before + text == calm_text
        assert tokens + rest == calm_tokens
        assert last.finish_reason == calm_last.finish_reason
        assert last.stop_string == calm_last.stop_string
    finally:
        stack.start_engine(victim)
        stack.wait_routable(2)
    if case == "matches across the switch":
        assert calm_text == uninterrupted[0][:10]
        assert calm_last.finish_reason == pb.FINISH_REASON_STOP
    else:
        assert calm_text == uninterrupted[0]
