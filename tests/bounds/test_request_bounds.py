"""Requests one client makes large are refused at once, naming the field, the value and the
limit, while the server goes on serving others: a chat bomb (500,000 empty messages), a chat
whose roles hold its size, a 1.3M-id Detokenize, a text past the context, a message past the
server's size limit (RESOURCE_EXHAUSTED from gRPC itself); at the engine, the router and the
engine's HTTP API. No timing is asserted: a legitimate stream started first must complete."""

from __future__ import annotations

import json
import random
import threading
import urllib.error
import urllib.request

import grpc
import pytest

from engine_service.serving.connection_limits import generation_request_bytes
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from router.config import DEFAULT_CONTEXT_TOKENS
from tests.bounds.conftest import CONTEXT_TOKENS, greedy

VOCAB = 49152  # the tiny Llama's (SmolLM2's tokenizer)
MAX_CHARS = 32 * CONTEXT_TOKENS  # CHARS_PER_CONTEXT_TOKEN * the engine's context


class LegitStream:
    """A streaming request running in a thread while a test sends its bomb; `finish()` joins it
    and checks it got every token."""

    def __init__(self, stub: pb_grpc.GenerationStub, max_tokens: int = 16) -> None:
        self.max_tokens = max_tokens
        self.tokens: list[int] = []
        self.error: BaseException | None = None
        request = greedy(max_tokens, text="A legitimate client, served meanwhile.")
        request.sampling.ignore_eos = True
        self._call = stub.GenerateStream(request, timeout=120)
        self._thread = threading.Thread(target=self._read)
        self._thread.start()

    def _read(self) -> None:
        try:
            for message in self._call:
                for choice in message.choices:
                    self.tokens.extend(choice.token_ids)
        except BaseException as error:  # noqa: BLE001 - reported by finish()
            self.error = error

    def finish(self) -> None:
        self._thread.join(timeout=180)
        assert self.error is None, self.error
        assert len(self.tokens) == self.max_tokens


def refused(call, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as error:
        call(request, timeout=120)
    return error.value


def empty_chat(num_messages: int) -> pb.ChatMessages:
    chat = pb.ChatMessages()
    chat.messages.extend([pb.ChatMessage(role="user")] * num_messages)
    return chat


@pytest.fixture(params=["engine", "router"])
def front(request, bounded):
    """A stub on the engine or on the router, and the front's name."""
    target = bounded.engine.target if request.param == "engine" else bounded.router.target
    with bounded.channel(target) as channel:
        yield request.param, pb_grpc.GenerationStub(channel)


def test_chat_bomb_refused_by_its_count_while_others_are_served(front):
    name, stub = front
    # 500,000 empty messages (4 MiB) at the router, as in the issue; the engine's messages
    # are sized for its 4096-token context (0.6 MiB), so it gets 60,000 of them (0.5 MiB).
    num_messages = 500_000 if name == "router" else 60_000
    legit = LegitStream(stub)
    bomb = greedy(chat=empty_chat(num_messages))
    error = refused(lambda request, timeout: list(stub.GenerateStream(request, timeout=timeout)),
                    bomb)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == (f"chat.messages must hold at most 256 messages, "
                               f"got {num_messages}")
    error = refused(stub.Generate, bomb)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    legit.finish()


def test_chat_size_counts_every_field(front):
    """The roles count: a chat whose size is all in one role is refused by its size."""
    _, stub = front
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="u" * MAX_CHARS, content="hi")])
    error = refused(stub.Generate, greedy(chat=chat))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == (f"chat.messages must hold at most {MAX_CHARS} characters in all "
                               f"(roles, contents, tool calls and tools), got {MAX_CHARS + 2}")
    error = refused(stub.Tokenize, pb.TokenizeRequest(chat=chat))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "characters in all (roles, contents, tool calls and tools)" in error.details()


def test_chat_bomb_at_the_engine_past_its_message_size(bounded):
    """The issue's 4 MiB bomb is past the engine's message size: gRPC refuses it unread."""
    with bounded.channel(bounded.engine.target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        legit = LegitStream(stub)
        error = refused(stub.Generate, greedy(chat=empty_chat(500_000)))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert str(generation_request_bytes(CONTEXT_TOKENS)) in error.details()
        legit.finish()


def test_chat_bomb_over_http(bounded):
    body = json.dumps({"messages": [{"role": "user", "content": ""}] * 500_000,
                       "max_tokens": 4}).encode()
    request = urllib.request.Request(
        f"https://127.0.0.1:{bounded.http_port}/v1/chat/completions", data=body,
        headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as error:  # (the engine asks for a certificate)
        urllib.request.urlopen(request, timeout=120, context=bounded.certs.ssl_context("client"))
    assert error.value.code == 400
    reply = json.loads(error.value.read())["error"]
    assert reply["param"] == "messages"
    assert reply["message"] == "messages must hold at most 256 messages, got 500000"


def test_huge_detokenize_refused_while_others_are_served(front):
    name, stub = front
    ids = random.Random(0).choices(range(VOCAB), k=1_300_000 if name == "router" else 100_000)
    legit = LegitStream(stub)
    error = refused(stub.Detokenize, pb.DetokenizeRequest(token_ids=ids))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith(f"token_ids must hold at most {CONTEXT_TOKENS} ids")
    assert error.details().endswith(f"got {len(ids)}")
    # A context's worth is still decoded.
    text = stub.Detokenize(pb.DetokenizeRequest(token_ids=ids[:CONTEXT_TOKENS]), timeout=120)
    assert text.text
    legit.finish()


def test_detokenize_past_the_engine_message_size(bounded):
    """1.3M ids (3.9 MB) are past the engine's message size: refused by gRPC, unread."""
    with bounded.channel(bounded.engine.target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        ids = random.Random(1).choices(range(VOCAB), k=1_300_000)
        error = refused(stub.Detokenize, pb.DetokenizeRequest(token_ids=ids))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_text_past_the_context_refused_by_its_size(front):
    _, stub = front
    text = "x" * (MAX_CHARS + 1)
    for call, request in ((stub.Generate, greedy(text=text)),
                          (stub.Tokenize, pb.TokenizeRequest(text=text))):
        error = refused(call, request)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.details() == f"text must be at most {MAX_CHARS} characters, got {len(text)}"


def test_message_past_the_size_limit_is_resource_exhausted(front, bounded):
    name, stub = front
    limit = generation_request_bytes(CONTEXT_TOKENS if name == "engine"
                                     else DEFAULT_CONTEXT_TOKENS)
    legit = LegitStream(stub)
    error = refused(stub.Generate, greedy(text="y" * (limit + 1)))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert str(limit) in error.details()
    legit.finish()
