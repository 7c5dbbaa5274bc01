"""Generation over real gRPC: the stream and the unary call agree, n>1 carries indices, and 64
concurrent streams give the offline API's outputs token for token."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from engine_service import SamplingParams
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from tests.service.streams import assemble, from_unary

REQUESTS = {
    "greedy_text": pb.GenerateRequest(
        text="The quick brown fox", sampling=pb.SamplingParams(temperature=0, max_tokens=10)),
    "seeded_n3_logprobs": pb.GenerateRequest(
        text="Once upon a time",
        sampling=pb.SamplingParams(n=3, temperature=0.8, top_p=0.9, seed=7, max_tokens=8,
                                   logprobs=2)),
    "chat": pb.GenerateRequest(
        chat=pb.ChatMessages(messages=[
            pb.ChatMessage(role="system", content="You are terse."),
            pb.ChatMessage(role="user", content="Name a colour."),
        ]),
        sampling=pb.SamplingParams(temperature=0, max_tokens=6)),
    "token_ids_stop_token": pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[1, 504, 3458, 2040, 30, 260]),
        sampling=pb.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)),
}


@pytest.mark.parametrize("name", sorted(REQUESTS))
def test_stream_and_unary_give_the_same_result(stub, name):
    request = REQUESTS[name]
    streamed = assemble(stub.GenerateStream(request, timeout=60))
    unary = stub.Generate(request, timeout=60)
    n = request.sampling.n if request.sampling.HasField("n") else 1
    assert sorted(streamed.completions) == list(range(n))
    assert streamed.completions == from_unary(unary)
    assert streamed.num_finished_messages == 1
    for c in streamed.completions.values():
        assert c.num_finish_messages == 1  # a finish reason is sent once per completion
        assert c.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
        assert 1 <= len(c.token_ids) <= request.sampling.max_tokens
        if request.sampling.HasField("logprobs"):
            assert len(c.logprobs) == len(c.token_ids)
            for lp, token in zip(c.logprobs, c.token_ids, strict=True):
                assert lp.token_id == token and lp.logprob <= 0 and lp.rank >= 1
                assert len(lp.top) >= request.sampling.logprobs
    usage = unary.usage
    assert usage.prompt_tokens == streamed.usage.prompt_tokens > 0
    assert usage.completion_tokens == streamed.usage.completion_tokens == sum(
        len(c.token_ids) for c in streamed.completions.values())
    # The second run finds the first one's full prompt blocks in the prefix cache.
    assert usage.cached_tokens == usage.prompt_tokens // 16 * 16 - (
        16 if usage.prompt_tokens % 16 == 0 else 0)


def test_prompt_logprobs_come_once_and_match_the_offline_api(stub, offline_llm):
    """In one stream message (the first token's), in the unary reply, as the offline API scores
    the prompt; the second request's prompt is cached, but a scored prompt reads no cache."""
    ids = [1, 504, 3458, 2040, 30, 260, 3458, 2040, 30, 260, 504, 3458, 2040, 30, 260, 1,
           504, 3458, 2040, 30, 260]
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(
        temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=2))
    messages = list(stub.GenerateStream(request, timeout=60))
    carrying = [i for i, m in enumerate(messages) if m.prompt_logprobs]
    assert len(carrying) == 1
    first_token = next(i for i, m in enumerate(messages) if any(c.token_ids for c in m.choices))
    assert carrying == [first_token]
    unary = stub.Generate(request, timeout=60)
    assert list(unary.prompt_logprobs) == list(messages[carrying[0]].prompt_logprobs)
    assert unary.usage.cached_tokens == 0
    [reference] = offline_llm.generate([{"prompt_token_ids": ids}], SamplingParams(
        temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=2))
    assert reference.prompt_logprobs[0] is None
    assert len(unary.prompt_logprobs) == len(ids) - 1
    for wire, local, token in zip(unary.prompt_logprobs, reference.prompt_logprobs[1:], ids[1:],
                                  strict=True):
        assert wire.token_id == local.token_id == token and wire.rank == local.rank
        assert wire.logprob == pytest.approx(local.logprob, abs=1e-5)
        assert {t.token_id: pytest.approx(t.logprob, abs=1e-5) for t in wire.top} == local.top
    plain = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(
        temperature=0, max_tokens=3, ignore_eos=True))
    assert not stub.Generate(plain, timeout=60).prompt_logprobs


def test_request_id_is_echoed_or_generated(stub):
    params = pb.SamplingParams(temperature=0, max_tokens=2)
    named = stub.Generate(pb.GenerateRequest(request_id="my-req.1", text="hi", sampling=params))
    assert named.request_id == "my-req.1"
    first = stub.Generate(pb.GenerateRequest(text="hi", sampling=params))
    second = stub.Generate(pb.GenerateRequest(text="hi", sampling=params))
    assert len(first.request_id) == 32 and first.request_id != second.request_id


def test_stop_string_is_reported_and_not_in_text(stub, offline_llm):
    probe = offline_llm.generate("Alpha beta gamma", SamplingParams(temperature=0, max_tokens=8))
    text = probe[0].outputs[0].text
    stop = text[len(text) // 2 :][:3]
    assert stop.strip(), f"need a visible stop string in {text!r}"
    reply = stub.Generate(pb.GenerateRequest(
        text="Alpha beta gamma",
        sampling=pb.SamplingParams(temperature=0, max_tokens=8, stop=[stop])))
    [c] = reply.completions
    assert c.finish_reason == pb.FINISH_REASON_STOP and c.stop_string == stop
    assert c.text == text[: text.index(stop)]


def test_tokenize_detokenize_and_model_info(stub, offline_llm):
    tokenizer = offline_llm.get_tokenizer()
    tokens = stub.Tokenize(pb.TokenizeRequest(text="Hello world"))
    assert list(tokens.token_ids) == tokenizer.encode("Hello world")
    chat = stub.Tokenize(pb.TokenizeRequest(chat=pb.ChatMessages(
        messages=[pb.ChatMessage(role="user", content="Hi")])))
    assert chat.prompt.endswith("<|im_start|>assistant\n")
    assert list(chat.token_ids) == tokenizer.encode(chat.prompt, add_special_tokens=False)
    text = stub.Detokenize(pb.DetokenizeRequest(token_ids=tokens.token_ids)).text
    assert text == "Hello world"
    info = stub.ModelInfo(pb.ModelInfoRequest())
    assert (info.vocab_size, info.max_model_len, info.block_size, info.num_blocks) == (
        49152, 4096, 16, 240)
    assert info.architecture == "LlamaForCausalLM" and 2 in info.eos_token_ids
    assert info.dtype == "float32"  # what the server was started with (--dtype float32)
    # Named by its directory; the hash identity is that name and the weights' fingerprint,
    # not the path (tests/engine/test_model_identity.py).
    assert info.served_model_name == Path(info.model_path).name
    assert info.model_identity.startswith(info.served_model_name + ":")
    assert info.model_path not in info.model_identity


PROMPT_TOPICS = ["rivers", "mountains", "the moon", "bread", "trains", "music", "chess", "rain"]


def concurrent_prompts() -> list[tuple[str, int]]:
    """64 distinct prompts, max_tokens varied so requests finish at different steps."""
    return [
        (f"Request {i}: write about {PROMPT_TOPICS[i % 8]} and number {i * 7}", 4 + i % 13)
        for i in range(64)
    ]


async def _stream_all(engine_server, prompts: list[tuple[str, int]]):
    async with engine_server.aio_channel() as channel:
        stub = pb_grpc.GenerationStub(channel)

        async def one(text: str, max_tokens: int):
            call = stub.GenerateStream(pb.GenerateRequest(
                text=text, sampling=pb.SamplingParams(temperature=0, max_tokens=max_tokens)),
                timeout=120)
            return assemble([message async for message in call])

        return await asyncio.gather(*(one(t, m) for t, m in prompts))


def test_64_concurrent_streams_match_the_offline_api(engine_server, offline_llm):
    prompts = concurrent_prompts()
    streamed = asyncio.run(_stream_all(engine_server, prompts))
    expected = offline_llm.generate(
        [t for t, _ in prompts], [SamplingParams(temperature=0, max_tokens=m) for _, m in prompts])
    assert len(streamed) == 64
    for (text, _), got, want in zip(prompts, streamed, expected, strict=True):
        [completion] = got.completions.values()
        assert got.num_finished_messages == 1, text
        assert completion.token_ids == want.outputs[0].token_ids, text
        assert completion.text == want.outputs[0].text, text
        assert got.usage.prompt_tokens == len(want.prompt_token_ids)


BEAM_REQUEST = pb.GenerateRequest(
    text="The old lighthouse keeper",
    sampling=pb.SamplingParams(beam_width=4, n=3, max_tokens=10, ignore_eos=True,
                               length_penalty=0.5, early_stopping=pb.EARLY_STOPPING_NEVER))


def test_beam_search_streams_only_the_final_beams(stub, offline_llm):
    from engine_service import BeamSearchParams

    messages = list(stub.GenerateStream(BEAM_REQUEST, timeout=60))
    assert len(messages) == 1 and messages[0].finished  # the beams, once the search is over
    streamed = assemble(messages)
    unary = stub.Generate(BEAM_REQUEST, timeout=60)
    assert streamed.completions == from_unary(unary)
    [expected] = offline_llm.beam_search("The old lighthouse keeper", BeamSearchParams(
        beam_width=4, n=3, max_tokens=10, ignore_eos=True, length_penalty=0.5,
        early_stopping="never"))
    assert [c.index for c in unary.completions] == [0, 1, 2]  # best first
    for c, want in zip(unary.completions, expected.sequences, strict=True):
        assert list(c.token_ids) == want.token_ids and c.text == want.text
        assert c.finish_reason == pb.FINISH_REASON_LENGTH
        assert c.HasField("cumulative_logprob")
        assert c.cumulative_logprob == pytest.approx(want.cum_logprob, abs=1e-4)
    assert unary.usage.completion_tokens == 30
    info = stub.ModelInfo(pb.ModelInfoRequest())
    assert info.max_beam_width == 64
    # Sampled completions carry no cumulative logprob.
    greedy = stub.Generate(pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(
        temperature=0, max_tokens=2)))
    assert not greedy.completions[0].HasField("cumulative_logprob")
