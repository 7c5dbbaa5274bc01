"""Every error status of the engine's HTTP API, in OpenAI's shape, as the official client sees
it: 400 a bad field (named in `param`), 401 no or a wrong key, 404 an unknown model or path,
429 the queue full, 503 draining; and the plain endpoints."""

from __future__ import annotations

import asyncio
import json
import signal

import openai
import pytest

from tests.http.conftest import API_KEY, start_engine

CHAT = [{"role": "user", "content": "Hello"}]


def error_of(raised: pytest.ExceptionInfo) -> dict:
    body = raised.value.response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize(("kwargs", "param", "words"), [
    ({"temperature": -1}, "temperature", "temperature must be >= 0"),
    ({"max_tokens": 10_000}, "max_tokens", "max_tokens must be at most"),
    ({"logprobs": 21}, "logprobs", "logprobs must be between 0 and 20"),
    ({"n": 0}, "n", "n must be between 1 and"),
    ({"top_p": 1.5}, "top_p", "top_p"),
    ({"stop": [1]}, "stop", "stop must be a string or a list of strings"),
    ({"echo": True, "logprobs": 21}, "logprobs", "logprobs must be between 0 and 20"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens must be >= 1"),  # (0 only with echo)
    ({"max_tokens": 0, "echo": True, "extra_body": {"min_tokens": 2}}, "min_tokens",
     "min_tokens must be 0 with max_tokens 0 (echo: the prompt alone), got 2"),
    ({"prompt": "", "echo": True, "logprobs": 1}, "prompt", "must be a non-empty string"),
    ({"echo": True, "logprobs": 1, "extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs",
     "prompt_logprobs must be left unset with echo and logprobs (the prompt's come in "
     "logprobs), got 1"),
    ({"extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs",
     "prompt_logprobs must be between 0 and 20, got 21"),
    ({"prompt": ["ok", []], "echo": True, "logprobs": 1}, "prompt[1]",
     "must hold at least one token id"),
    ({"suffix": "x"}, "suffix", "suffix is not supported"),
    ({"extra_body": {"guided_json": None, "echo": False}}, None, None),  # asks for nothing
    ({"extra_body": {"guided_regex": "(abc"}}, "guided_regex",
     "guided_regex must be a valid regular expression, got one that does not compile: Regex "
     "parsing error at position 5: The parenthesis is not closed."),
    ({"extra_body": {"guided_json": {"type": "objekt"}}}, "guided_json",
     'guided_json must be a valid JSON Schema, got one that does not compile: Unsupported type '
     '"objekt"'),
    ({"extra_body": {"guided_json": "{oops"}}, "guided_json", "guided_json must be a JSON "
     "Schema in JSON text, got text that is not JSON"),
    ({"extra_body": {"guided_choice": []}}, "guided_choice", "must hold 1 to 1024 strings"),
    ({"extra_body": {"guided_json": '{"anyOf":[' * 2000 + "{}" + "]}" * 2000}}, "guided_json",
     "guided_json must nest objects and arrays at most 64 levels deep"),
    ({"extra_body": {"guided_grammar": "root ::= x"}}, "guided_grammar", "is not defined"),
    ({"extra_body": {"guided_regex": "a+", "guided_choice": ["a"]}}, "guided_choice",
     "guided_choice and guided_regex must not both be set"),
    ({"extra_body": {"structured_outputs": {}}}, "structured_outputs",
     "structured_outputs must set one of"),
    ({"extra_body": {"structured_outputs": {"regex": "(", "choice": ["a"]}}},
     "structured_outputs.choice", "must not both be set"),
    ({"extra_body": {"guided_regex": "a+", "ignore_eos": True}}, "ignore_eos",
     "ignore_eos must be False with structured_outputs"),
    ({"extra_body": {"guided_regex": "a+", "use_beam_search": True}, "temperature": 0},
     "guided_regex", "must be left unset with beam search"),
    ({"extra_body": {"colour": "red"}}, "colour", "colour is not a field"),
    ({"extra_body": {"top_k": -5}}, "top_k", "top_k"),
    ({"extra_body": {"min_tokens": 20}, "max_tokens": 4}, "min_tokens", "min_tokens must be <="),
    ({"prompt": ""}, "prompt", "prompt must be a non-empty string"),
    ({"prompt": [99_999_999]}, "prompt", "the vocabulary"),
    ({"prompt": ["ok", [99_999_999]], "echo": True}, "prompt[1]", "the vocabulary"),
    ({"prompt": ["ok", [1, "x"]]}, "prompt[1]", "prompt[1] must be a string or a list"),
    ({"stop": ["ok", ""]}, "stop", "stop must hold non-empty strings"),
    ({"stop": "z" * 300}, "stop", "stop must hold strings of at most 256 characters"),
    ({"max_tokens": 3000, "n": 2}, "max_tokens", "max_tokens and n must fit"),
    ({"extra_body": {"length_penalty": 2.0}}, "length_penalty",
     "length_penalty and early_stopping must"),
])
def test_completions_400_names_the_field(client, http_engine, kwargs, param, words):
    kwargs = {"prompt": "Hello", "max_tokens": 4, **kwargs}
    if words is None:
        assert client.completions.create(model=http_engine.model, **kwargs).choices
        return
    for stream in (False, True):  # refused before the stream starts: a status, not an event
        with pytest.raises(openai.BadRequestError) as raised:
            client.completions.create(model=http_engine.model, stream=stream, **kwargs)
        error = error_of(raised)
        assert error["param"] == param and words in error["message"], error
        assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(("kwargs", "param", "words"), [
    ({"messages": [{"role": "critic", "content": "x"}]}, "messages[0].role", "must be one of"),
    ({"messages": []}, "messages", "at least one message"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url",
                                                 "image_url": {"url": "http://x"}}]}]},
     "messages[0].content", "text parts"),
    ({"top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs: true"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "top_logprobs must be between"),
    ({"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens", "must agree"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", "max_completion_tokens must be"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice",
     '"auto" (the default with tools)'),  # (test_tool_calls.py: what is served)
    ({"extra_body": {"echo": True}}, "echo", "echo is not supported"),  # (completions' only)
    ({"extra_body": {"echo": False}}, None, None),  # vLLM's clients send it: accepted
    ({"extra_body": {"echo": None}}, None, None),
    ({"response_format": {"type": "json_object"}}, None, None),
    ({"response_format": {"type": "text"}}, None, None),  # asks for nothing: accepted
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema",
     "must be set when type is json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}},
     "response_format.json_schema.schema", "response_format.json_schema.schema must be a "
     "valid JSON Schema, got one that does not compile: Cannot find field 'nope' in #/nope"),
    ({"response_format": {"type": "xml"}}, "response_format.type", ""),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}},
     "guided_regex", "guided_regex and response_format must not both be set"),
    ({"logit_bias": {"five": 10}}, "logit_bias", "logit_bias must map token ids"),
    ({"logit_bias": {"5": 101}}, "logit_bias[5]", "logit_bias[5] must be in [-100, 100]"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias", "the model's vocab size"),
    ({"logit_bias": {"9" * 4301: 1}}, "logit_bias", "logit_bias must map token ids"),
    ({"logit_bias": {"5": 1, "05": 100}}, "logit_bias", "without leading zeros"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias",
     "logit_bias must hold at most 1024 entries, got 1025"),
    ({"logit_bias": {"5": 100.0001}}, "logit_bias[5]", "got 100.0001"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed with stream"),
    ({"messages": [{"role": "user", "content": "x" * 1_000_000}]}, "messages",
     "messages must hold at most"),
])
def test_chat_400_names_the_field(client, http_engine, kwargs, param, words):
    kwargs = {"messages": CHAT, "max_tokens": 4, **kwargs}
    if "max_completion_tokens" in kwargs and "max_tokens" in kwargs and (
            kwargs["max_completion_tokens"] == 0):
        del kwargs["max_tokens"]
    if words is None:
        assert client.chat.completions.create(model=http_engine.model, **kwargs).choices
        return
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=http_engine.model, **kwargs)
    error = error_of(raised)
    assert error["param"].startswith(param) and words in error["message"], error


def test_bodies_that_are_not_requests(http_engine):
    url = f"{http_engine.base_url}/v1/chat/completions"
    status, body = http_engine.call(url, b"{not json", API_KEY)
    assert status == 400 and "must be JSON" in body["error"]["message"]
    status, body = http_engine.call(url, b"[1, 2]", API_KEY)
    assert status == 400 and "JSON object" in body["error"]["message"]
    status, body = http_engine.call(url, {"model": http_engine.model}, API_KEY)
    assert status == 400 and body["error"]["param"] == "messages"
    assert body["error"]["message"] == "messages is required"


def test_401_without_or_with_a_wrong_key(http_engine):
    with http_engine.openai("wrong-key", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError) as raised:
            bad.completions.create(model=http_engine.model, prompt="Hi", max_tokens=2)
        error = error_of(raised)
        assert error["code"] == "invalid_api_key" and error["type"] == "authentication_error"
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    for path, body in (("/v1/models", None), ("/v1/chat/completions", {"messages": CHAT})):
        # no Authorization header
        status, reply = http_engine.call(f"{http_engine.base_url}{path}", body)
        assert status == 401 and reply["error"]["code"] == "invalid_api_key"
        assert "needs an API key" in reply["error"]["message"]
    # The tokenizer tools and unknown paths need the key too: a caller without one learns
    # nothing (not the model's name from a 404, not a token count); only the probes are open.
    for path, body in (("/tokenize", {"prompt": "Hello"}), ("/detokenize", {"tokens": [1]}),
                       ("/v1/embeddings", {"input": "x"}), ("/metrics", None)):
        status, reply = http_engine.call(f"{http_engine.base_url}{path}", body)
        assert status == 401 and reply["error"]["code"] == "invalid_api_key", path
        assert http_engine.model not in json.dumps(reply)
    assert http_engine.call(f"{http_engine.base_url}/health")[0] == 200
    assert http_engine.call(f"{http_engine.base_url}/version")[0] == 200


def test_404_unknown_model_and_path(client, http_engine):
    with pytest.raises(openai.NotFoundError) as raised:
        client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=2)
    error = error_of(raised)
    assert error["param"] == "model" and error["code"] == "model_not_found"
    assert json.dumps(http_engine.model) in error["message"]  # JSON quotes, not repr
    status, body = http_engine.call(f"{http_engine.base_url}/v1/embeddings", {"input": "x"},
                                    API_KEY)
    assert status == 404 and "not served here" in body["error"]["message"]


def test_models_tokenize_detokenize_version(client, http_engine):
    from tests.service.conftest import MAX_MODEL_LEN

    [model] = client.models.list().data
    assert model.id == http_engine.model and model.owned_by == "pagedgen"
    assert model.model_extra["max_model_len"] == MAX_MODEL_LEN
    base = http_engine.base_url
    status, tokens = http_engine.call(f"{base}/tokenize",
                                      {"model": model.id, "prompt": "Hello world"}, API_KEY)
    assert status == 200 and tokens["count"] == len(tokens["tokens"]) > 0
    assert tokens["max_model_len"] == MAX_MODEL_LEN
    status, text = http_engine.call(f"{base}/detokenize", {"tokens": tokens["tokens"]}, API_KEY)
    assert status == 200 and text == {"prompt": "Hello world"}
    status, chat = http_engine.call(f"{base}/tokenize", {"messages": CHAT}, API_KEY)
    reply = client.chat.completions.create(model=model.id, messages=CHAT, max_tokens=1)
    assert status == 200 and chat["count"] == reply.usage.prompt_tokens
    status, body = http_engine.call(f"{base}/tokenize", {"prompt": "x", "messages": CHAT}, API_KEY)
    assert status == 400 and "exactly one of" in body["error"]["message"]
    status, body = http_engine.call(f"{base}/detokenize", {"tokens": [10**9]}, API_KEY)
    assert status == 400 and body["error"]["param"] == "tokens"
    status, version = http_engine.call(f"{base}/version")
    assert status == 200 and version["version"]


# ---- 429 and 503 on an engine of their own ----------------------------------------------------
def test_429_when_the_queue_is_full_then_503_while_draining(tiny_llama_dir, tmp_path,
                                                           test_certs):
    engine = start_engine(tiny_llama_dir, tmp_path / "engine.log", test_certs,
                          ["--max-live-requests", "1", "--grace-s", "120"])
    async def body() -> None:
        client = engine.async_openai("unused", max_retries=0, timeout=120)
        long = await client.chat.completions.create(
            model=engine.model, messages=CHAT, max_tokens=3000, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        first = await long.__anext__()  # admitted: the one live request
        assert first.choices[0].delta.role == "assistant"
        with pytest.raises(openai.RateLimitError) as raised:
            await client.completions.create(model=engine.model, prompt="Hi", max_tokens=2)
        error = error_of(raised)
        assert error["type"] == "rate_limit_error" and "queue limit" in error["message"]

        engine.process.proc.send_signal(signal.SIGTERM)  # drains: the long stream keeps it up
        while (await asyncio.to_thread(engine.call, f"{engine.base_url}/health"))[0] == 200:
            await asyncio.sleep(0.05)
        status, health = await asyncio.to_thread(engine.call, f"{engine.base_url}/health")
        assert status == 503 and health["status"] == "not serving"
        with pytest.raises(openai.InternalServerError) as raised:
            await client.chat.completions.create(model=engine.model, messages=CHAT,
                                                 max_tokens=2)
        assert raised.value.status_code == 503
        error = error_of(raised)
        assert "draining" in error["message"] and error["type"] == "service_unavailable_error"
        async for _ in long:  # the live stream still runs while the engine drains
            break
        await long.close()  # and leaving it lets the drain end
        await client.close()

    try:
        asyncio.run(body())
        assert engine.process.proc.wait(60) == 0
    finally:
        engine.process.kill()
