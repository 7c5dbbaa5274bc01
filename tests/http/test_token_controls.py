"""vLLM's allowed_token_ids and truncate_prompt_tokens over HTTP (the official openai client,
extra_body): the output holds allowed tokens alone; a prompt is cut to its last tokens before
it runs (token ids, text and chat; a token-id prompt past the context is cut, not refused),
and bad values are 400s naming the field."""

from __future__ import annotations

import pytest

from tests.http.conftest import API_KEY

EOS = 2  # the tiny model's (SmolLM2's <|im_end|>)


def context(http_engine) -> int:
    status, models = http_engine.call(f"{http_engine.base_url}/v1/models", api_key=API_KEY,
                                      method="GET")
    assert status == 200
    return models["data"][0]["max_model_len"]


def detokenized(http_engine, ids: list[int]) -> str:
    status, reply = http_engine.call(f"{http_engine.base_url}/detokenize",
                                     {"model": http_engine.model, "tokens": ids}, API_KEY)
    assert status == 200, reply
    return reply["prompt"]


def test_the_output_holds_only_allowed_tokens(http_engine, client):
    reply = client.completions.create(
        model=http_engine.model, prompt="The sky is", max_tokens=5, temperature=1.0, seed=1,
        extra_body={"allowed_token_ids": [1234], "ignore_eos": True})
    assert reply.choices[0].text == detokenized(http_engine, [1234] * 5)
    chat = client.chat.completions.create(
        model=http_engine.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
        temperature=0, extra_body={"allowed_token_ids": [1234, 1235], "ignore_eos": True})
    assert chat.choices[0].message.content in {
        detokenized(http_engine, list(ids)) for ids in
        [(a, b, c) for a in (1234, 1235) for b in (1234, 1235) for c in (1234, 1235)]}


def test_a_prompt_is_cut_to_its_last_tokens(http_engine, client):
    ids = [(7 * i) % 30000 + 100 for i in range(context(http_engine) + 50)]  # past the context
    cut = client.completions.create(model=http_engine.model, prompt=ids, max_tokens=4,
                                    temperature=0,
                                    extra_body={"truncate_prompt_tokens": 5, "ignore_eos": True})
    last = client.completions.create(model=http_engine.model, prompt=ids[-5:], max_tokens=4,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert cut.usage.prompt_tokens == 5 and cut.choices[0].text == last.choices[0].text
    short = client.completions.create(model=http_engine.model, prompt="Short",
                                      max_tokens=1).usage.prompt_tokens
    batch = client.completions.create(model=http_engine.model, prompt=[ids, "Short"],
                                      max_tokens=1, extra_body={"truncate_prompt_tokens": 5})
    assert batch.usage.prompt_tokens == 5 + min(5, short)
    text = client.completions.create(model=http_engine.model, prompt="one two three four five",
                                     max_tokens=1, extra_body={"truncate_prompt_tokens": 3})
    assert text.usage.prompt_tokens == 3


def test_a_chat_past_the_context_is_cut_and_runs_to_its_end(http_engine, client):
    """Without max_tokens a chat may run to the end of the context: counted from the cut
    prompt (from the whole one it had room for 1 token)."""
    long = [{"role": "user", "content": "word " * context(http_engine)}]
    chat = client.chat.completions.create(
        model=http_engine.model, messages=long, temperature=0,
        extra_body={"truncate_prompt_tokens": 4, "allowed_token_ids": [1234, EOS],
                    "logit_bias": {str(EOS): 100}, "min_tokens": 2})
    assert chat.usage.prompt_tokens == 4
    assert chat.choices[0].finish_reason == "stop"  # EOS once min_tokens let it
    assert chat.usage.completion_tokens == 3


@pytest.mark.parametrize(("extra", "param", "words"), [
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "truncate_prompt_tokens must be"),
    ({"truncate_prompt_tokens": -5}, "truncate_prompt_tokens", "got -5"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "at least one token id"),
    ({"allowed_token_ids": [99_999_999]}, "allowed_token_ids", "the model's vocab size"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids", "non-negative"),
    ({"allowed_token_ids": [5], "guided_regex": "a+"}, "allowed_token_ids",
     "must be left unset with structured_outputs"),
])
def test_bad_values_are_400s_naming_the_field(http_engine, extra, param, words):
    for path, body in (("/v1/completions", {"prompt": "Hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user",
                                                                "content": "Hi"}]})):
        status, reply = http_engine.call(f"{http_engine.base_url}{path}",
                                         {"model": http_engine.model, "max_tokens": 2,
                                          **body, **extra}, API_KEY)
        assert status == 400, (path, reply)
        assert reply["error"]["param"] == param, (path, reply)
        assert words in reply["error"]["message"], (path, reply)


def test_logprobs_name_tokens_by_id_when_asked(http_engine, client):
    """vLLM's return_tokens_as_token_ids: "token_id:ID" for each token and its alternatives
    (a chat entry's bytes are that name's), whole and streamed; echo's prompt tokens too."""
    named = "token_id:1234"
    ask = {"allowed_token_ids": [1234], "ignore_eos": True, "return_tokens_as_token_ids": True}
    reply = client.completions.create(model=http_engine.model, prompt=[5, 6, 7], max_tokens=3,
                                      logprobs=2, echo=True, extra_body=ask)
    logprobs = reply.choices[0].logprobs
    assert logprobs.tokens == ["token_id:5", "token_id:6", "token_id:7", named, named, named]
    assert all(key.startswith("token_id:") for top in logprobs.top_logprobs[1:] for key in top)
    # Offsets still count the text: the choice's text is what they index.
    text = reply.choices[0].text
    assert logprobs.text_offset[-1] == len(text) - len(detokenized(http_engine, [1234]))
    chat = {"model": http_engine.model, "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2, "logprobs": True, "top_logprobs": 2, "extra_body": ask}
    whole = client.chat.completions.create(**chat).choices[0].logprobs.content
    streamed = [entry for chunk in client.chat.completions.create(**chat, stream=True)
                for choice in chunk.choices if choice.logprobs
                for entry in choice.logprobs.content]
    for entries in (whole, streamed):
        assert [e.token for e in entries] == [named, named]
        assert all(e.bytes == list(named.encode()) for e in entries)
        assert all(t.token.startswith("token_id:") for e in entries for t in e.top_logprobs)
    plain = client.completions.create(model=http_engine.model, prompt=[5, 6, 7], max_tokens=1,
                                      logprobs=0, extra_body={"allowed_token_ids": [1234]})
    assert plain.choices[0].logprobs.tokens == [detokenized(http_engine, [1234])]


def test_bad_words_are_never_written(http_engine, client):
    """A token forced by logit_bias, banned as a word: the output writes it nowhere, over
    gRPC's wire (the HTTP front's) with the words tokenized by the engine's front."""
    word = detokenized(http_engine, [1234])
    forced = {"logit_bias": {"1234": 100}, "ignore_eos": True}
    assert client.completions.create(model=http_engine.model, prompt="Hi", max_tokens=3,
                                     temperature=0, extra_body=forced
                                     ).choices[0].text == word * 3
    banned = client.completions.create(model=http_engine.model, prompt="Hi", max_tokens=3,
                                       temperature=0, logprobs=0,
                                       extra_body={**forced, "bad_words": [word],
                                                   "return_tokens_as_token_ids": True})
    assert "token_id:1234" not in banned.choices[0].logprobs.tokens
    assert len(banned.choices[0].logprobs.tokens) == 3


@pytest.mark.parametrize(("extra", "words"), [
    ({"bad_words": [" "]}, "non-space character"),
    ({"bad_words": ["w"] * 129}, "at most 128 words, got 129"),
    ({"bad_words": ["w"], "guided_regex": "a+"}, "must be left unset with structured_outputs"),
    ({"bad_words": ["w"], "allowed_token_ids": [5]}, "must be left unset with allowed_token"),
])
def test_bad_words_refused_name_the_field(http_engine, extra, words):
    status, reply = http_engine.call(f"{http_engine.base_url}/v1/completions",
                                     {"model": http_engine.model, "prompt": "Hi",
                                      "max_tokens": 2, **extra}, API_KEY)
    assert status == 400 and reply["error"]["param"] == "bad_words", reply
    assert words in reply["error"]["message"], reply


def test_a_cut_text_prompt_echoes_what_ran(http_engine, client):
    """Echo with truncate_prompt_tokens: the kept tokens' text, and logprobs that start with
    them (the whole text was echoed, with the first token's entry from its start)."""
    whole = "one two three four five"
    status, tokenized = http_engine.call(f"{http_engine.base_url}/tokenize",
                                         {"model": http_engine.model, "prompt": whole}, API_KEY)
    assert status == 200
    kept = tokenized["tokens"][-3:]
    for stream in (False, True):
        reply = client.completions.create(
            model=http_engine.model, prompt=whole, max_tokens=1, echo=True, logprobs=0,
            temperature=0, stream=stream,
            extra_body={"truncate_prompt_tokens": 3, "return_tokens_as_token_ids": True})
        choices = [c for chunk in reply for c in chunk.choices] if stream else reply.choices
        text = "".join(c.text for c in choices)
        tokens = [t for c in choices if c.logprobs for t in c.logprobs.tokens]
        assert text.startswith(detokenized(http_engine, kept)), text
        assert not text.startswith("one")
        assert tokens[:3] == [f"token_id:{t}" for t in kept]
    plain = client.completions.create(model=http_engine.model, prompt=whole, max_tokens=1,
                                      echo=True, extra_body={"truncate_prompt_tokens": 3})
    assert plain.choices[0].text.startswith(detokenized(http_engine, kept))


@pytest.mark.parametrize(("prompt", "param", "words"), [
    ([5, "junk", 6, 7], "prompt", '"junk" at position 1'),
    ([-5, 6, 7], "prompt", "-5 at position 0"),
    ([[5, 6, 7], [6, 5.5, 6, 7]], "prompt[1]", "5.5 at position 1"),
    ([[5, 6, 7], [2**40, 6, 7]], "prompt[1]", f"{2**40} at position 0"),
    ([-1] + [5] * 5000, "prompt", "-1 at position 0"),  # past the context: the id is named
])
def test_a_malformed_token_prompt_is_refused_whatever_is_cut(http_engine, prompt, param,
                                                              words):
    status, reply = http_engine.call(f"{http_engine.base_url}/v1/completions",
                                     {"model": http_engine.model, "prompt": prompt,
                                      "max_tokens": 1, "truncate_prompt_tokens": 2}, API_KEY)
    assert status == 400 and reply["error"]["param"] == param, reply
    assert reply["error"]["message"] == (f"{param} must hold token ids (32-bit ints >= 0), "
                                         f"got {words}")


@pytest.mark.parametrize("keep", [0, -2])
def test_a_cut_that_keeps_nothing_is_named_before_the_prompt_s_length(http_engine, keep):
    status, reply = http_engine.call(f"{http_engine.base_url}/v1/completions",
                                     {"model": http_engine.model, "prompt": [5] * 5000,
                                      "max_tokens": 1, "truncate_prompt_tokens": keep}, API_KEY)
    assert status == 400 and reply["error"]["param"] == "truncate_prompt_tokens", reply
    assert reply["error"]["message"].endswith(f"got {keep}")


def test_a_cut_token_prompt_is_read_up_to_16_contexts(http_engine):
    limit = 16 * context(http_engine)
    status, reply = http_engine.call(f"{http_engine.base_url}/v1/completions",
                                     {"model": http_engine.model, "prompt": [5] * (limit + 1),
                                      "max_tokens": 1, "truncate_prompt_tokens": 2}, API_KEY)
    assert status == 400 and reply["error"]["param"] == "prompt", reply
    assert reply["error"]["message"] == (f"prompt must be at most {limit} tokens (16 contexts) "
                                         f"to be cut by truncate_prompt_tokens, got {limit + 1} "
                                         f"tokens")


def test_minus_one_cuts_to_what_the_engine_can_run(http_engine, client):
    """-1: the longest prompt the engine takes, its KV pool's as well as its context's (this
    engine's pool holds fewer tokens than its context)."""
    ids = [100 + (i * 13) % 30000 for i in range(context(http_engine) + 900)]
    reply = client.completions.create(model=http_engine.model, prompt=ids, max_tokens=1,
                                      extra_body={"truncate_prompt_tokens": -1})
    assert reply.usage.prompt_tokens == 240 * 16 - 1  # the test engine's 240 blocks of 16
    echoed = client.completions.create(model=http_engine.model, prompt=ids, max_tokens=1,
                                       echo=True, logprobs=0, temperature=0,
                                       extra_body={"truncate_prompt_tokens": -1,
                                                   "return_tokens_as_token_ids": True})
    tokens = echoed.choices[0].logprobs.tokens
    assert tokens[:-1] == [f"token_id:{t}" for t in ids[-(240 * 16 - 1):]]  # what ran


@pytest.mark.parametrize(("prompt", "extra", "message"), [
    ([5, 2**40], {}, f"prompt must hold token ids (32-bit ints), got {2**40} at position 1"),
    ([5, "x", 6], {}, 'prompt must hold token ids (32-bit ints), got "x" at position 1'),
    ([2**40, 5], {"truncate_prompt_tokens": 1},
     f"prompt must hold token ids (32-bit ints >= 0), got {2**40} at position 0"),
])
def test_a_token_prompt_s_bad_id_is_named_with_its_position(http_engine, prompt, extra,
                                                            message):
    """(A list starting with an id is a token-id prompt: its bad element was blamed on the
    first id, or the list was read as a list of prompts.)"""
    status, reply = http_engine.call(f"{http_engine.base_url}/v1/completions",
                                     {"model": http_engine.model, "prompt": prompt,
                                      "max_tokens": 1, **extra}, API_KEY)
    assert status == 400 and reply["error"]["param"] == "prompt", reply
    assert reply["error"]["message"] == message


def test_minus_one_leaves_room_for_every_sequence(http_engine, client):
    """-1 with n = 2 (a chat without max_tokens, and completions): the cut leaves the pool
    room for both sequences (cut for one, the request was refused naming max_tokens)."""
    long = [{"role": "user", "content": "word " * context(http_engine)}]
    ends = {"allowed_token_ids": [1234, EOS], "logit_bias": {str(EOS): 100},
            "truncate_prompt_tokens": -1}
    chat = client.chat.completions.create(model=http_engine.model, messages=long, n=2,
                                          extra_body=ends)
    assert len(chat.choices) == 2 and chat.usage.prompt_tokens > 3000
    ids = [100 + (i * 13) % 30000 for i in range(context(http_engine) + 10)]
    text = client.completions.create(model=http_engine.model, prompt=ids, n=2, max_tokens=1,
                                     extra_body={"truncate_prompt_tokens": -1})
    assert len(text.choices) == 2 and text.usage.prompt_tokens > 3000
