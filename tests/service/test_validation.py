"""Every kind of bad input gets its status code and a message naming the field, and none of them
disturbs a good request running at the same time."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import grpc

from engine_service import SamplingParams
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from tests.service.conftest import MAX_MODEL_LEN
from tests.service.streams import assemble

INVALID = grpc.StatusCode.INVALID_ARGUMENT
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


def sampling(**fields) -> pb.SamplingParams:
    return pb.SamplingParams(**fields)


def chat(*pairs: tuple[str, str]) -> pb.ChatMessages:
    return pb.ChatMessages(messages=[pb.ChatMessage(role=r, content=c) for r, c in pairs])


@dataclass
class BadCase:
    name: str
    request: pb.GenerateRequest
    code: grpc.StatusCode
    message: str  # must appear in the status details


def bad_cases() -> list[BadCase]:
    ok = dict(text="hello", sampling=sampling(max_tokens=4))
    cases = [
        BadCase("no input", pb.GenerateRequest(sampling=sampling(max_tokens=4)), INVALID,
                "input must be one of text, token_ids or chat, got none"),
        BadCase("empty text", pb.GenerateRequest(text=""), INVALID,
                "text must be a non-empty string, got ''"),
        BadCase("empty token ids", pb.GenerateRequest(token_ids=pb.TokenIds()), INVALID,
                "token_ids.ids must hold at least one token id, got []"),
        BadCase("token id past the vocabulary",
                pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 49152])), INVALID,
                "token_ids.ids must be in [0, 49152) (the vocabulary), got 49152 at position 1"),
        BadCase("negative token id", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[-3])),
                INVALID, "token_ids.ids must be in [0, 49152) (the vocabulary), got -3"),
        BadCase("prompt longer than the context",
                pb.GenerateRequest(token_ids=pb.TokenIds(ids=[7] * MAX_MODEL_LEN)), INVALID,
                f"prompt must be at most {MAX_MODEL_LEN - 1} tokens"),
        BadCase("oversized text", pb.GenerateRequest(text="a" * (32 * MAX_MODEL_LEN + 1)),
                INVALID, f"text must be at most {32 * MAX_MODEL_LEN} characters"),
        BadCase("temperature < 0", pb.GenerateRequest(text="x", sampling=sampling(
            temperature=-0.5)), INVALID, "sampling.temperature must be >= 0"),
        BadCase("temperature NaN", pb.GenerateRequest(text="x", sampling=sampling(
            temperature=float("nan"))), INVALID, "sampling.temperature must be a finite number"),
        BadCase("top_p = 0", pb.GenerateRequest(text="x", sampling=sampling(top_p=0)), INVALID,
                "sampling.top_p must be in (0, 1], got 0.0"),
        BadCase("top_p > 1", pb.GenerateRequest(text="x", sampling=sampling(top_p=1.5)),
                INVALID, "sampling.top_p must be in (0, 1], got 1.5"),
        BadCase("n = 0", pb.GenerateRequest(text="x", sampling=sampling(n=0)), INVALID,
                "sampling.n must be between 1 and 64, got 0"),
        BadCase("n above the limit", pb.GenerateRequest(text="x", sampling=sampling(n=65)),
                INVALID, "sampling.n must be between 1 and 64, got 65"),
        BadCase("max_tokens = 0", pb.GenerateRequest(text="x", sampling=sampling(max_tokens=0)),
                INVALID, "sampling.max_tokens must be >= 1 or None, got 0"),
        BadCase("max_tokens < 0", pb.GenerateRequest(text="x", sampling=sampling(
            max_tokens=-5)), INVALID, "sampling.max_tokens must be >= 1 or None, got -5"),
        BadCase("max_tokens past the context", pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[7] * 10), sampling=sampling(max_tokens=MAX_MODEL_LEN)),
            INVALID, f"sampling.max_tokens must be at most {MAX_MODEL_LEN - 10}"),
        BadCase("huge stop list", pb.GenerateRequest(text="x", sampling=sampling(
            stop=[f"s{i}" for i in range(17)])), INVALID,
            "sampling.stop must hold at most 16 strings, got 17"),
        BadCase("empty stop string", pb.GenerateRequest(text="x", sampling=sampling(
            stop=["ok", ""])), INVALID, "sampling.stop must hold non-empty strings"),
        BadCase("huge stop string", pb.GenerateRequest(text="x", sampling=sampling(
            stop=["z" * 300])), INVALID,
            "sampling.stop must hold strings of at most 256 characters"),
        BadCase("stop token id past the vocabulary", pb.GenerateRequest(
            text="x", sampling=sampling(stop_token_ids=[2, 60000])), INVALID,
            "sampling.stop_token_ids must be < the model's vocab size 49152, got 60000"),
        BadCase("logit bias past the vocabulary", pb.GenerateRequest(
            text="x", sampling=sampling(logit_bias={2: 1.0, 60000: 5.0})), INVALID,
            "sampling.logit_bias must map token ids < the model's vocab size 49152, got the "
            "key 60000"),
        BadCase("logit bias past 100", pb.GenerateRequest(
            text="x", sampling=sampling(logit_bias={7: 100.5})), INVALID,
            "sampling.logit_bias[7] must be in [-100, 100], got 100.5"),
        BadCase("negative logit bias key", pb.GenerateRequest(
            text="x", sampling=sampling(logit_bias={-3: 1.0})), INVALID,
            "sampling.logit_bias must map non-negative token ids to biases, got the key -3"),
        BadCase("logit bias with beam search", pb.GenerateRequest(
            text="x", sampling=sampling(beam_width=2, logit_bias={7: 1.0})), INVALID,
            "sampling.logit_bias must be left unset with beam search"),
        BadCase("a full logit bias with beam search", pb.GenerateRequest(
            text="x", sampling=sampling(beam_width=2, logit_bias={
                i: 1.0 for i in range(1024)})), INVALID,
            "sampling.logit_bias must be left unset with beam search (beam_width set): not "
            "supported there, got 1024 entries"),
        BadCase("top_k < -1", pb.GenerateRequest(text="x", sampling=sampling(top_k=-2)),
                INVALID, "sampling.top_k must be -1 or 0 (off) or >= 1, got -2"),
        BadCase("min_p > 1", pb.GenerateRequest(text="x", sampling=sampling(min_p=2)), INVALID,
                "sampling.min_p must be in [0, 1], got 2.0"),
        BadCase("too many logprobs", pb.GenerateRequest(text="x", sampling=sampling(
            logprobs=21)), INVALID, "sampling.logprobs must be between 0 and 20, got 21"),
        BadCase("negative prompt logprobs", pb.GenerateRequest(text="x", sampling=sampling(
            prompt_logprobs=-1)), INVALID,
            "sampling.prompt_logprobs must be between 0 and 20, got -1"),
        BadCase("presence penalty out of range", pb.GenerateRequest(text="x", sampling=sampling(
            presence_penalty=3)), INVALID, "sampling.presence_penalty must be in [-2, 2]"),
        BadCase("repetition penalty 0", pb.GenerateRequest(text="x", sampling=sampling(
            repetition_penalty=0)), INVALID, "sampling.repetition_penalty must be > 0"),
        BadCase("min_tokens > max_tokens", pb.GenerateRequest(text="x", sampling=sampling(
            min_tokens=9, max_tokens=4)), INVALID,
            "sampling.min_tokens must be <= max_tokens (4), got 9"),
        BadCase("bad chat role", pb.GenerateRequest(chat=chat(("user", "hi"), ("robot", "beep"))),
                INVALID, "chat.messages[1].role must be one of ('system', 'user', 'assistant', "
                "'tool'), got 'robot'"),
        BadCase("tools not JSON", pb.GenerateRequest(chat=pb.ChatMessages(
            messages=chat(("user", "hi")).messages, tools_json="[{")), INVALID,
            "chat.tools_json must be a JSON array of tools, got text that does not parse"),
        BadCase("a tool not a function", pb.GenerateRequest(chat=pb.ChatMessages(
            messages=chat(("user", "hi")).messages, tools_json='[{"type": "web"}]')), INVALID,
            'chat.tools_json[0] must be {"type": "function", "function": {"name": NAME, ...}}, '
            'got {"type": "web"}'),
        BadCase("a user's tool call", pb.GenerateRequest(chat=pb.ChatMessages(messages=[
            pb.ChatMessage(role="user", content="hi", tool_calls=[pb.ToolCall(name="f")])])),
            INVALID, "chat.messages[0].tool_calls must be empty in a user's message (an "
                     "assistant's calls), got 1"),
        BadCase("no chat messages", pb.GenerateRequest(chat=chat()), INVALID,
                "chat.messages must hold at least one message, got []"),
        BadCase("too many chat messages", pb.GenerateRequest(chat=chat(*[("user", "a")] * 257)),
                INVALID, "chat.messages must hold at most 256 messages, got 257"),
        BadCase("oversized chat message", pb.GenerateRequest(chat=chat(
            ("user", "b" * (32 * MAX_MODEL_LEN + 1)))), INVALID,
            f"chat.messages must hold at most {32 * MAX_MODEL_LEN} characters in all (roles, "
            f"contents, tool calls and tools), got {32 * MAX_MODEL_LEN + 5}"),
        BadCase("bad request id", pb.GenerateRequest(request_id="has space", **ok), INVALID,
                "request_id must be 1 to 128 characters of [A-Za-z0-9._:-]"),
        BadCase("oversized cache salt", pb.GenerateRequest(cache_salt="s" * 257, **ok), INVALID,
                "cache_salt must be at most 256 characters, got 257"),
        BadCase("beam search with temperature", pb.GenerateRequest(text="x", sampling=sampling(
            beam_width=2, temperature=0.8)), INVALID,
            "sampling.temperature must be 0 with beam search (beam_width set), got 0.8"),
        BadCase("beam_width 0", pb.GenerateRequest(text="x", sampling=sampling(beam_width=0)),
                INVALID, "sampling.beam_width must be between 1 and 64, got 0"),
        BadCase("n above beam_width", pb.GenerateRequest(text="x", sampling=sampling(
            beam_width=2, n=3)), INVALID, "sampling.n must be at most beam_width (2)"),
        BadCase("beam search with stop strings", pb.GenerateRequest(text="x", sampling=sampling(
            beam_width=2, stop=["."])), INVALID,
            "sampling.stop must be left unset with beam search"),
        BadCase("beam_width negative", pb.GenerateRequest(text="x", sampling=sampling(
            beam_width=-2)), INVALID, "sampling.beam_width must be between 1 and 64, got -2"),
        BadCase("beam_width above the limit", pb.GenerateRequest(text="x", sampling=sampling(
            beam_width=65)), INVALID, "sampling.beam_width must be between 1 and 64, got 65"),
        BadCase("beam search with logprobs", pb.GenerateRequest(text="x", sampling=sampling(
            beam_width=2, logprobs=1)), INVALID,
            "sampling.logprobs must be left unset with beam search"),
        BadCase("beam search with a penalty", pb.GenerateRequest(text="x", sampling=sampling(
            beam_width=2, repetition_penalty=1.2)), INVALID,
            "sampling.repetition_penalty must be left unset with beam search"),
        # 100 ** 1000 overflows: the engine thread died on it (OverflowError in a beam step).
        BadCase("length_penalty that overflows the beam scores", pb.GenerateRequest(
            text="x", sampling=sampling(beam_width=2, max_tokens=100, length_penalty=1000)),
            INVALID, "length_penalty must be between -14.99 and 14.99 for beams of up to 100 "
            "tokens"),
        BadCase("unknown early_stopping", pb.GenerateRequest(text="x", sampling=sampling(
            beam_width=2, early_stopping=7)), INVALID,
            "sampling.early_stopping must be one of EARLY_STOPPING_FALSE, EARLY_STOPPING_TRUE, "
            "EARLY_STOPPING_NEVER, got 7"),
        BadCase("length_penalty without beam search", pb.GenerateRequest(
            text="x", sampling=sampling(length_penalty=2)), INVALID,
            "sampling.length_penalty and early_stopping must be left at 1.0 and False unless "
            "beam_width is set"),
        # 10 prompt tokens + 1000: 64 blocks per beam, none of them full-prompt: 4 x 64 > 240.
        BadCase("beam group that can never fit in the KV pool", pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[7] * 10), sampling=sampling(beam_width=4,
                                                                   max_tokens=1000)),
            INVALID, "request needs up to 256 KV blocks but the pool has 240"),
        # 10 + 3900 tokens need 245 blocks of 16; the pool has 240: it can never run.
        BadCase("can never fit in the KV pool", pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[7] * 10), sampling=sampling(max_tokens=3900)),
            INVALID, "request needs up to 245 KV blocks but the pool has 240"),
    ]
    return cases


GOOD = pb.GenerateRequest(
    text="A good request runs beside the bad ones",
    sampling=pb.SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))


async def _bad_beside_good(engine_server, cases: list[BadCase]):
    async with engine_server.aio_channel() as channel:
        stub = pb_grpc.GenerationStub(channel)
        good = stub.GenerateStream(GOOD, timeout=120)
        first = await good.read()  # the good request is running before the bad ones arrive
        errors = []
        for case in cases:
            call = stub.Generate(case.request, timeout=30)
            try:
                await call
                errors.append((case, grpc.StatusCode.OK, ""))
            except grpc.aio.AioRpcError as error:
                errors.append((case, error.code(), error.details()))
        messages = [first]
        while (message := await good.read()) is not grpc.aio.EOF:
            messages.append(message)
        return errors, assemble(messages)


def test_bad_inputs_get_their_status_and_leave_a_good_request_alone(engine_server, stub,
                                                                     offline_llm):
    cases = bad_cases()
    assert len(cases) >= 20
    errors, good = asyncio.run(_bad_beside_good(engine_server, cases))
    for case, code, details in errors:
        assert code == case.code, f"{case.name}: {code} {details!r}"
        assert case.message in details, f"{case.name}: {details!r}"
        assert "must" in details and "got" in details, f"{case.name}: {details!r}"
    [want] = offline_llm.generate(GOOD.text, SamplingParams(temperature=0, max_tokens=48,
                                                            ignore_eos=True))
    [completion] = good.completions.values()
    assert completion.token_ids == want.outputs[0].token_ids
    assert completion.finish_reason == pb.FINISH_REASON_LENGTH
    stats = stub.EngineStats(pb.EngineStatsRequest())
    assert stats.num_free_blocks == stats.num_blocks and stats.num_live_requests == 0


def test_duplicate_live_request_id_is_already_exists(engine_server, stub):
    async def body():
        async with engine_server.aio_channel() as channel:
            astub = pb_grpc.GenerationStub(channel)
            first = astub.GenerateStream(pb.GenerateRequest(
                request_id="dup-1", text="first",
                sampling=pb.SamplingParams(max_tokens=2000, ignore_eos=True)), timeout=60)
            await first.read()
            try:
                await astub.Generate(pb.GenerateRequest(request_id="dup-1", text="second"))
            except grpc.aio.AioRpcError as error:
                return error.code(), error.details()
            finally:
                first.cancel()
            return grpc.StatusCode.OK, ""

    code, details = asyncio.run(body())
    assert code == grpc.StatusCode.ALREADY_EXISTS
    assert details == "request_id must be unique among live requests, got 'dup-1'"
    # Once the server has seen the cancellation, the id is free again.
    deadline = time.monotonic() + 5
    while stub.EngineStats(pb.EngineStatsRequest()).num_live_requests:
        assert time.monotonic() < deadline, "the cancelled request stayed live"
        time.sleep(0.01)
    reply = stub.Generate(pb.GenerateRequest(request_id="dup-1", text="again",
                                             sampling=pb.SamplingParams(max_tokens=2)))
    assert reply.request_id == "dup-1"


def test_other_rpcs_validate_too(stub):
    try:
        stub.Detokenize(pb.DetokenizeRequest(token_ids=[1, 99999]))
        raise AssertionError("Detokenize accepted an id past the vocabulary")
    except grpc.RpcError as error:
        assert error.code() == INVALID
        assert "token_ids must be in [0, 49152) (the vocabulary), got 99999" in error.details()
    try:
        stub.Tokenize(pb.TokenizeRequest(chat=chat(("wizard", "x"))))
        raise AssertionError("Tokenize accepted a bad role")
    except grpc.RpcError as error:
        assert error.code() == INVALID and "chat.messages[0].role must be" in error.details()
    # Tokenize's input is text or chat: the refusal names those, not Generate's three.
    try:
        stub.Tokenize(pb.TokenizeRequest())
        raise AssertionError("Tokenize accepted no input")
    except grpc.RpcError as error:
        assert error.code() == INVALID
        assert error.details() == "input must be one of text or chat, got none of them"
