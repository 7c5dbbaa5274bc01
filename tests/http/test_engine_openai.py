"""The engine's OpenAI-compatible HTTP API through the official `openai` client (sync and async,
streaming and not), checked against the same engine's gRPC answers."""

from __future__ import annotations

import asyncio
import re
from typing import Literal

import openai
import pytest

from pagedgen_api import generation_pb2 as pb
from tests.http.conftest import API_KEY
from tests.service.test_cancel import wait_all_free

PROMPT = "The quick brown fox jumps over the lazy dog because"
CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three colours."}]


def stream_text(chunks) -> tuple[dict[int, str], dict[int, str], list]:
    """Texts and finish reasons by choice index, and the chunks' usages (last one last)."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usages = []
    for chunk in chunks:
        usages.append(chunk.usage)
        for choice in chunk.choices:
            piece = choice.text if hasattr(choice, "text") else (choice.delta.content or "")
            texts[choice.index] = texts.get(choice.index, "") + piece
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, usages


# ---- completions and chat, whole and streamed ------------------------------------------------
def test_completion_greedy_stream_equals_whole(client, http_engine):
    whole = client.completions.create(model=http_engine.model, prompt=PROMPT, max_tokens=12,
                                      temperature=0)
    assert whole.object == "text_completion" and whole.model == http_engine.model
    [choice] = whole.choices
    assert choice.finish_reason == "length" and choice.text
    assert whole.usage.completion_tokens == 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12
    chunks = list(client.completions.create(
        model=http_engine.model, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    texts, reasons, usages = stream_text(chunks)
    assert texts == {0: choice.text} and reasons == {0: "length"}
    assert all(u is None for u in usages[:-1])  # usage only in the last chunk, asked for
    assert chunks[-1].choices == [] and usages[-1].completion_tokens == 12
    assert usages[-1].prompt_tokens == whole.usage.prompt_tokens


def test_chat_greedy_sync_and_async_stream_equal_whole(client, async_client, http_engine):
    whole = client.chat.completions.create(model=http_engine.model, messages=CHAT,
                                           max_completion_tokens=10, temperature=0)
    assert whole.object == "chat.completion"
    [choice] = whole.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert whole.usage.completion_tokens == 10

    async def streamed():
        stream = await async_client.chat.completions.create(
            model=http_engine.model, messages=CHAT, max_tokens=10, temperature=0, stream=True)
        chunks = [chunk async for chunk in stream]
        unstreamed = await async_client.chat.completions.create(
            model=http_engine.model, messages=CHAT, max_tokens=10, temperature=0)
        await async_client.close()
        return chunks, unstreamed

    chunks, unstreamed = asyncio.run(streamed())
    assert chunks[0].choices[0].delta.role == "assistant"
    texts, reasons, usages = stream_text(chunks)
    assert texts == {0: choice.message.content} and reasons == {0: "length"}
    assert all(u is None for u in usages)  # not asked for
    assert unstreamed.choices[0].message.content == choice.message.content


def test_chat_without_max_tokens_runs_to_the_end_of_the_context(client, http_engine):
    """OpenAI's default: no max_tokens means up to the context (here, the KV pool's 3840
    tokens, which is smaller); ignore_eos makes it run there."""
    from tests.service.conftest import BLOCK_SIZE, NUM_BLOCKS

    reply = client.chat.completions.create(model=http_engine.model, messages=CHAT,
                                           temperature=0, extra_body={"ignore_eos": True})
    usage = reply.usage
    assert reply.choices[0].finish_reason == "length"
    assert usage.prompt_tokens + usage.completion_tokens == NUM_BLOCKS * BLOCK_SIZE


def test_n_and_a_list_of_prompts(client, http_engine):
    prompts = [PROMPT, [1, 2, 3, 4, 5]]
    reply = client.completions.create(model=http_engine.model, prompt=prompts, n=2,
                                      max_tokens=6, temperature=0.8, seed=11)
    assert sorted(c.index for c in reply.choices) == [0, 1, 2, 3]
    alone = [client.completions.create(model=http_engine.model, prompt=p, n=2, max_tokens=6,
                                       temperature=0.8, seed=11) for p in prompts]
    by_index = {c.index: c.text for c in reply.choices}
    for i, single in enumerate(alone):
        for c in single.choices:  # choice i*n + k is prompt i's k-th
            assert by_index[i * 2 + c.index] == c.text
    assert reply.usage.completion_tokens == 4 * 6
    assert reply.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in alone)
    chunks = list(client.completions.create(model=http_engine.model, prompt=prompts, n=2,
                                            max_tokens=6, temperature=0.8, seed=11,
                                            stream=True))
    texts, reasons, _ = stream_text(chunks)
    assert texts == by_index and set(reasons) == {0, 1, 2, 3}


def test_echo_puts_the_prompt_before_every_completion(client, http_engine, engine_stub):
    """OpenAI's echo: each choice's text starts with its prompt's (a token-id prompt's decoded
    with its special tokens), whole and streamed; the usage counts what it did without."""
    ids = list(engine_stub.Tokenize(pb.TokenizeRequest(text="Hi there")).token_ids)
    prompts = [PROMPT, [1, *ids]]  # (id 1: SmolLM2's <|im_start|>, a special token)
    texts = [PROMPT, "<|im_start|>Hi there"]
    plain = client.completions.create(model=http_engine.model, prompt=prompts, n=2,
                                      max_tokens=6, temperature=0.8, seed=5)
    echoed = client.completions.create(model=http_engine.model, prompt=prompts, n=2,
                                       max_tokens=6, temperature=0.8, seed=5, echo=True)
    without = {c.index: c.text for c in plain.choices}
    assert {c.index: c.text for c in echoed.choices} == {
        i: texts[i // 2] + text for i, text in without.items()}
    assert echoed.usage.prompt_tokens == plain.usage.prompt_tokens
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens == 4 * 6
    chunks = list(client.completions.create(model=http_engine.model, prompt=prompts, n=2,
                                            max_tokens=6, temperature=0.8, seed=5, echo=True,
                                            stream=True))
    streamed, reasons, _ = stream_text(chunks)
    assert streamed == {c.index: c.text for c in echoed.choices}
    assert set(reasons) == {0, 1, 2, 3}
    firsts = {}
    for chunk in chunks:
        for choice in chunk.choices:
            firsts.setdefault(choice.index, choice.text)
    assert all(firsts[i].startswith(texts[i // 2]) for i in range(4))  # sent once, first


def test_echo_with_logprobs_scores_the_prompt_as_the_engine_does(client, http_engine,
                                                                 engine_stub):
    """OpenAI's echo with logprobs (lm-eval's loglikelihood): a choice's logprobs start with
    its prompt's tokens, the first with null, the others as the engine's prompt_logprobs;
    then the completion's, as without echo. With max_tokens 0, the prompt alone."""
    text_ids = list(engine_stub.Tokenize(pb.TokenizeRequest(text=PROMPT)).token_ids)
    prompts = [PROMPT, [1, *text_ids[:5]]]
    ids = [text_ids, prompts[1]]
    scored = [engine_stub.Generate(pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=p), sampling=pb.SamplingParams(
            temperature=0, max_tokens=1, prompt_logprobs=2))).prompt_logprobs for p in ids]
    texts = [PROMPT, engine_stub.Detokenize(pb.DetokenizeRequest(
        token_ids=prompts[1], skip_special_tokens=False)).text]
    plain = client.completions.create(model=http_engine.model, prompt=prompts, max_tokens=4,
                                      temperature=0, logprobs=2)
    echoed = client.completions.create(model=http_engine.model, prompt=prompts, max_tokens=4,
                                       temperature=0, logprobs=2, echo=True)
    streamed = list(client.completions.create(model=http_engine.model, prompt=prompts,
                                              max_tokens=4, temperature=0, logprobs=2,
                                              echo=True, stream=True))
    alone = client.completions.create(model=http_engine.model, prompt=prompts, max_tokens=0,
                                      temperature=0, logprobs=2, echo=True)
    assert alone.usage.completion_tokens == 0
    assert alone.usage.prompt_tokens == echoed.usage.prompt_tokens == len(ids[0]) + len(ids[1])
    for i in range(2):
        lp, without = echoed.choices[i].logprobs, plain.choices[i].logprobs
        num_prompt = len(ids[i])
        assert echoed.choices[i].text == texts[i] + plain.choices[i].text
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:num_prompt] == pytest.approx(
            [s.logprob for s in scored[i]], abs=1e-5)
        assert all(len(top) >= 2 for top in lp.top_logprobs[1:num_prompt])
        assert lp.tokens[num_prompt:] == without.tokens
        assert lp.token_logprobs[num_prompt:] == pytest.approx(without.token_logprobs, abs=1e-5)
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
        # Streamed: the same tokens and logprobs, the prompt's in the choice's first chunk.
        pieces = [c.logprobs for chunk in streamed for c in chunk.choices if c.index == i]
        assert len(pieces[0].tokens) > num_prompt
        assert [t for p in pieces for t in p.tokens] == lp.tokens
        assert [v for p in pieces for v in p.token_logprobs] == pytest.approx(
            lp.token_logprobs, abs=1e-6)
        # max_tokens 0: the prompt's text and its tokens alone.
        only = alone.choices[i]
        assert only.text == texts[i] and only.finish_reason == "length"
        assert only.logprobs.tokens == lp.tokens[:num_prompt]
        assert only.logprobs.token_logprobs == lp.token_logprobs[:num_prompt]
    # The token generated and dropped ends with EOS (forced): still "length", no stop reason.
    eos = client.completions.create(model=http_engine.model, prompt=PROMPT, max_tokens=0,
                                    echo=True, logit_bias={"2": 100})
    assert eos.choices[0].text == PROMPT and eos.choices[0].finish_reason == "length"
    assert eos.choices[0].model_extra["stop_reason"] is None
    streamed_alone = list(client.completions.create(
        model=http_engine.model, prompt=prompts[0], max_tokens=0, temperature=0, logprobs=2,
        echo=True, stream=True, stream_options={"include_usage": True}))
    assert stream_text(streamed_alone)[0] == {0: texts[0]}
    assert streamed_alone[-1].usage.completion_tokens == 0


def test_vllm_prompt_logprobs_in_completions_and_chat(client, http_engine, engine_stub):
    """vLLM's prompt_logprobs: per completions choice (in its first chunk when streamed), in a
    whole chat response; null first, then {token id: {logprob, rank, decoded_token}}, as the
    engine scores the prompt."""
    ids = list(engine_stub.Tokenize(pb.TokenizeRequest(text=PROMPT)).token_ids)
    [engine] = [engine_stub.Generate(pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(
            temperature=0, max_tokens=1, prompt_logprobs=2))).prompt_logprobs]
    whole = client.completions.create(model=http_engine.model, prompt=PROMPT, max_tokens=3, n=2,
                                      temperature=0.5, seed=1, extra_body={"prompt_logprobs": 2})
    streamed = list(client.completions.create(
        model=http_engine.model, prompt=PROMPT, max_tokens=3, n=2, temperature=0.5, seed=1,
        stream=True, extra_body={"prompt_logprobs": 2}))
    firsts = {}
    for chunk in streamed:
        for choice in chunk.choices:
            firsts.setdefault(choice.index, choice.model_extra.get("prompt_logprobs"))
    for scored in [c.model_extra["prompt_logprobs"] for c in whole.choices] + list(
            firsts.values()):
        assert len(scored) == len(ids) and scored[0] is None
        for entry, lp, token in zip(scored[1:], engine, ids[1:], strict=True):
            assert entry[str(token)]["rank"] == lp.rank
            assert entry[str(token)]["logprob"] == pytest.approx(lp.logprob, abs=1e-5)
            assert {int(t) for t in entry} == {t.token_id for t in lp.top}
            assert sorted(v["rank"] for t, v in entry.items() if int(t) != token)[:2] == [1, 2]
        assert scored[1][str(ids[1])]["decoded_token"] == engine_stub.Detokenize(
            pb.DetokenizeRequest(token_ids=ids[1:2])).text
    assert sorted(firsts) == [0, 1]
    chat = client.chat.completions.create(model=http_engine.model, messages=CHAT, max_tokens=2,
                                          extra_body={"prompt_logprobs": 0})
    scored = chat.model_extra["prompt_logprobs"]
    assert scored[0] is None and len(scored) == chat.usage.prompt_tokens
    assert all(len(entry) == 1 for entry in scored[1:])  # the prompt token alone
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs must be left unset in a "
                                                     "chat stream"):
        client.chat.completions.create(model=http_engine.model, messages=CHAT, max_tokens=2,
                                       stream=True, extra_body={"prompt_logprobs": 0})


def test_chat_n_streams_every_choice(client, http_engine):
    chunks = list(client.chat.completions.create(
        model=http_engine.model, messages=CHAT, n=3, max_tokens=5, temperature=1.0, seed=3,
        stream=True))
    texts, reasons, _ = stream_text(chunks)
    assert set(texts) == {0, 1, 2} and reasons == {0: "length", 1: "length", 2: "length"}
    whole = client.chat.completions.create(model=http_engine.model, messages=CHAT, n=3,
                                           max_tokens=5, temperature=1.0, seed=3)
    assert {c.index: c.message.content for c in whole.choices} == texts


# ---- logprobs -----------------------------------------------------------------------------
def test_completion_logprobs_integer(client, http_engine):
    reply = client.completions.create(model=http_engine.model, prompt=PROMPT, max_tokens=8,
                                      temperature=0, logprobs=3)
    [choice] = reply.choices
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 3 <= len(top) <= 4 and top[token] == logprob
        assert logprob == max(top.values())  # greedy: the sampled token is the likeliest
    chunks = list(client.completions.create(model=http_engine.model, prompt=PROMPT,
                                            max_tokens=8, temperature=0, logprobs=3,
                                            stream=True))
    streamed = [t for c in chunks for ch in c.choices for t in ch.logprobs.tokens]
    assert streamed == lp.tokens
    offsets = [o for c in chunks for ch in c.choices for o in ch.logprobs.text_offset]
    assert offsets == lp.text_offset


def test_chat_logprobs_and_top_logprobs(client, http_engine):
    reply = client.chat.completions.create(model=http_engine.model, messages=CHAT,
                                           max_tokens=6, temperature=0, logprobs=True,
                                           top_logprobs=2)
    [choice] = reply.choices
    content = choice.logprobs.content
    assert len(content) == 6
    assert "".join(t.token for t in content) == choice.message.content
    for token in content:
        assert len(token.top_logprobs) == 2
        assert token.top_logprobs[0].logprob >= token.top_logprobs[1].logprob
        assert token.top_logprobs[0].token == token.token  # greedy
        assert bytes(token.bytes).decode() == token.token
    plain = client.chat.completions.create(model=http_engine.model, messages=CHAT,
                                           max_tokens=6, temperature=0, logprobs=True)
    assert [t.top_logprobs for t in plain.choices[0].logprobs.content] == [[]] * 6
    assert [t.logprob for t in plain.choices[0].logprobs.content] == [t.logprob
                                                                       for t in content]
    none = client.chat.completions.create(model=http_engine.model, messages=CHAT,
                                          max_tokens=6, temperature=0)
    assert none.choices[0].logprobs is None


# ---- stop, seed, cached tokens ----------------------------------------------------------------
def test_stop_strings(client, http_engine):
    free = client.completions.create(model=http_engine.model, prompt=PROMPT, max_tokens=16,
                                     temperature=0).choices[0].text
    stop = free[len(free) // 2:len(free) // 2 + 3]
    cut = free[:free.index(stop)]
    for stream in (False, True):
        reply = client.completions.create(model=http_engine.model, prompt=PROMPT,
                                          max_tokens=16, temperature=0, stop=[stop, "\x00"],
                                          stream=stream)
        if stream:
            texts, reasons, _ = stream_text(list(reply))
            assert texts == {0: cut} and reasons == {0: "stop"}
        else:
            choice = reply.choices[0]
            assert choice.text == cut and choice.finish_reason == "stop"
            assert choice.model_extra["stop_reason"] == stop


def test_seed_reproduces(client, async_client, http_engine):
    def sample(seed: int) -> str:
        return client.completions.create(model=http_engine.model, prompt=PROMPT,
                                         max_tokens=20, temperature=1.0, top_p=0.95,
                                         seed=seed).choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first

    async def async_sample() -> str:
        reply = await async_client.completions.create(model=http_engine.model, prompt=PROMPT,
                                                      max_tokens=20, temperature=1.0,
                                                      top_p=0.95, seed=1234)
        await async_client.close()
        return reply.choices[0].text

    assert asyncio.run(async_sample()) == first


def test_usage_counts_cached_tokens_on_a_repeated_prefix(client, http_engine):
    from tests.service.conftest import BLOCK_SIZE

    system = "You answer questions about the cached prefix test. " * 12  # several blocks
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi?"}]
    first = client.chat.completions.create(model=http_engine.model, messages=messages,
                                           max_tokens=2, temperature=0,
                                           extra_body={"cache_salt": "usage-test"})
    messages[1]["content"] = "And now?"
    again = client.chat.completions.create(model=http_engine.model, messages=messages,
                                           max_tokens=2, temperature=0,
                                           extra_body={"cache_salt": "usage-test"})
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= 4 * BLOCK_SIZE and cached % BLOCK_SIZE == 0
    assert cached < again.usage.prompt_tokens


# ---- the same request over gRPC ---------------------------------------------------------------
def test_greedy_tokens_over_http_equal_grpc(client, http_engine, engine_stub):
    for max_tokens in (1, 17):
        http = client.completions.create(model=http_engine.model, prompt=PROMPT,
                                         max_tokens=max_tokens, temperature=0, logprobs=0)
        grpc_reply = engine_stub.Generate(pb.GenerateRequest(
            text=PROMPT, sampling=pb.SamplingParams(temperature=0, max_tokens=max_tokens,
                                                    logprobs=0)), timeout=60)
        [completion] = grpc_reply.completions
        [choice] = http.choices
        assert choice.text == completion.text
        detokenized = [http_engine.call(f"{http_engine.base_url}/detokenize", {"tokens": [t]},
                            api_key=API_KEY)[1]["prompt"]
                       for t in completion.token_ids]
        assert choice.logprobs.tokens == detokenized
        assert choice.logprobs.token_logprobs == pytest.approx(
            [lp.logprob for lp in completion.logprobs], abs=1e-5)
        assert http.usage.prompt_tokens == grpc_reply.usage.prompt_tokens
    chat = client.chat.completions.create(model=http_engine.model, messages=CHAT,
                                          max_tokens=9, temperature=0)
    grpc_chat = engine_stub.Generate(pb.GenerateRequest(
        chat=pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in CHAT]),
        sampling=pb.SamplingParams(temperature=0, max_tokens=9)), timeout=60)
    assert chat.choices[0].message.content == grpc_chat.completions[0].text
    assert chat.usage.prompt_tokens == grpc_chat.usage.prompt_tokens


def test_logit_bias_forces_and_bans_tokens_as_over_grpc(client, http_engine, engine_stub):
    """OpenAI's logit_bias (token ids as strings) reaches the sampler as gRPC's map does: +100
    forces a token at every step, -100 bans the greedy one."""
    def grpc_greedy(bias: dict[int, float]) -> pb.Completion:
        reply = engine_stub.Generate(pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(
            temperature=0, max_tokens=6, ignore_eos=True, logit_bias=bias)), timeout=60)
        return reply.completions[0]

    plain = grpc_greedy({})
    forced_id = (plain.token_ids[0] + 1000) % 40000
    forced = grpc_greedy({forced_id: 100.0})
    assert list(forced.token_ids) == [forced_id] * 6
    banned = grpc_greedy({plain.token_ids[0]: -100.0})
    assert plain.token_ids[0] not in banned.token_ids
    for bias, expected in (({forced_id: 100.0}, forced), ({plain.token_ids[0]: -100.0}, banned)):
        http = client.completions.create(
            model=http_engine.model, prompt=PROMPT, max_tokens=6, temperature=0,
            logit_bias={str(k): v for k, v in bias.items()}, extra_body={"ignore_eos": True})
        assert http.choices[0].text == expected.text
    chat = client.chat.completions.create(
        model=http_engine.model, messages=CHAT, max_tokens=4, temperature=0,
        logit_bias={str(forced_id): 100}, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == forced.text[:len(chat.choices[0].message.content)]
    assert chat.usage.completion_tokens == 4


# ---- disconnects --------------------------------------------------------------------------
ABORTED = 'pagedgen_engine_requests_finished_total{finish_reason="abort"}'
TOKENS = "pagedgen_engine_generation_tokens_total"


def test_client_disconnect_mid_stream_aborts_and_frees_blocks(http_engine, engine_stub):
    async def body():
        client = http_engine.async_openai(API_KEY, max_retries=0, timeout=120)
        stream = await client.chat.completions.create(
            model=http_engine.model, messages=CHAT, max_tokens=3000, temperature=0,
            stream=True, extra_body={"ignore_eos": True})
        received = 0
        async for chunk in stream:
            received += len(chunk.choices)
            if received >= 5:
                break
        busy = engine_stub.EngineStats(pb.EngineStatsRequest(), timeout=10)
        await stream.close()
        await client.close()
        return busy

    aborted, tokens = http_engine.metric(ABORTED), http_engine.metric(TOKENS)
    busy = asyncio.run(body())
    assert busy.num_running == 1 and busy.num_free_blocks < busy.num_blocks
    wait_all_free(engine_stub)
    assert http_engine.metric(ABORTED) == aborted + 1
    assert http_engine.metric(TOKENS) - tokens < 3000


def test_client_disconnect_while_waiting_for_a_whole_reply_aborts(http_engine, engine_stub):
    """Not streamed: the client gives up (its timeout) while the engine generates."""
    aborted, tokens = http_engine.metric(ABORTED), http_engine.metric(TOKENS)
    client = http_engine.openai(API_KEY, max_retries=0, timeout=1.0)
    with pytest.raises(openai.APITimeoutError):
        client.completions.create(model=http_engine.model, prompt=PROMPT, max_tokens=3000,
                                  temperature=0, extra_body={"ignore_eos": True})
    wait_all_free(engine_stub)
    assert http_engine.metric(ABORTED) == aborted + 1  # ended by the client, not finished
    assert http_engine.metric(TOKENS) - tokens < 3000



def test_chat_text_parts_and_developer_role_are_the_plain_forms(client, http_engine):
    """OpenAI's content parts join as text, and its "developer" role is the template's
    system role: the same prompt (tokens) as the plain forms."""
    plain = client.chat.completions.create(model=http_engine.model, messages=CHAT,
                                           max_tokens=4, temperature=0)
    parts = client.chat.completions.create(
        model=http_engine.model, max_tokens=4, temperature=0,
        messages=[{"role": "developer", "content": CHAT[0]["content"]},
                  {"role": "user", "content": [{"type": "text", "text": CHAT[1]["content"]}]}])
    assert parts.usage.prompt_tokens == plain.usage.prompt_tokens
    assert parts.choices[0].message.content == plain.choices[0].message.content


# ---- structured outputs ---------------------------------------------------------------------
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "size"],
          "properties": {"name": {"enum": ["ant", "bee"]},
                         "size": {"type": "integer", "minimum": 1, "maximum": 9}}}


def test_response_format_json_schema_and_guided_fields(client, http_engine, engine_stub):
    """OpenAI's response_format and vLLM's guided_* reach the engine as gRPC's
    structured_outputs does: the same constrained text, valid by construction."""
    import json

    import jsonschema

    grpc_reply = engine_stub.Generate(pb.GenerateRequest(
        chat=pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in CHAT]),
        sampling=pb.SamplingParams(temperature=0, max_tokens=40, structured_outputs=(
            pb.StructuredOutputs(json=json.dumps(SCHEMA))))), timeout=60)
    grpc_text = grpc_reply.completions[0].text
    chat = client.chat.completions.create(
        model=http_engine.model, messages=CHAT, max_tokens=40, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "insect", "schema": SCHEMA, "strict": True}})
    [choice] = chat.choices
    assert choice.finish_reason == "stop" and choice.message.content == grpc_text
    jsonschema.validate(json.loads(grpc_text), SCHEMA)
    streamed = client.chat.completions.create(
        model=http_engine.model, messages=CHAT, max_tokens=40, temperature=0, stream=True,
        extra_body={"guided_json": SCHEMA})
    assert stream_text(streamed)[0] == {0: grpc_text}
    choices = ["left", "right"]
    completion = client.completions.create(
        model=http_engine.model, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=3, n=4,
        extra_body={"guided_choice": choices})
    assert {c.text for c in completion.choices} <= set(choices)
    regex = client.completions.create(
        model=http_engine.model, prompt=PROMPT, max_tokens=12, temperature=0,
        extra_body={"structured_outputs": {"regex": "[0-9]{2}:[0-9]{2}"}})
    assert re.fullmatch("[0-9]{2}:[0-9]{2}", regex.choices[0].text)
    obj = client.chat.completions.create(
        model=http_engine.model, messages=CHAT, max_tokens=30, temperature=0,
        response_format={"type": "json_object"})
    assert obj.choices[0].message.content.startswith("{")


def test_the_openai_clients_parse_with_a_pydantic_model(client, http_engine):
    """client.chat.completions.parse sends the model's strict JSON Schema (with $defs for a
    nested model) and parses the reply into it: the reply is an instance of the model."""
    import pydantic

    class Leg(pydantic.BaseModel):
        side: Literal["left", "right"]
        length: int

    class Insect(pydantic.BaseModel):
        name: Literal["ant", "bee"]
        legs: list[Leg] = pydantic.Field(max_length=2)
        flies: bool

    reply = client.chat.completions.parse(model=http_engine.model, messages=CHAT,
                                          max_tokens=120, temperature=0, response_format=Insect)
    [choice] = reply.choices
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Insect)
    assert choice.message.parsed.model_dump_json() == choice.message.content.replace(" ", "")
