"""Bodies a client should not send, and errors' shape, found by a new user's review:

- JSON nested thousands deep is a 400 on every endpoint (it was a 500 with a RecursionError
  from the chat message count's json.loads);
- a token-id prompt longer than the context is refused by its length before its ids are read
  one by one (15 million ids held the event loop, and every other stream, for seconds);
- `code` is a string or null, as OpenAI's (it was the status, an int, when no code was set);
- /pin_prefix names `tokens`.
"""

from __future__ import annotations

import json

import pytest

from tests.http.conftest import API_KEY

NESTED = ('{"a":' * 3000 + "1" + "}" * 3000).encode()
CHAT = [{"role": "user", "content": "Hello"}]


def _refused(http_engine, path: str, body: dict | bytes, status: int = 400) -> dict:
    got, reply = http_engine.call(f"{http_engine.base_url}{path}", body, API_KEY)
    assert got == status, reply
    assert set(reply["error"]) == {"message", "type", "param", "code"}
    assert reply["error"]["code"] is None or isinstance(reply["error"]["code"], str), reply
    return reply["error"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/tokenize",
                                  "/detokenize", "/pin_prefix"])
def test_deeply_nested_json_is_a_400(http_engine, path):
    error = _refused(http_engine, path, NESTED)
    assert error["type"] == "invalid_request_error"
    assert "the request body must be JSON" in error["message"]
    assert "RecursionError" not in http_engine.log_path.read_text()


def test_error_codes_are_strings_or_null(http_engine):
    assert _refused(http_engine, "/v1/completions",
                    {"model": http_engine.model, "prompt": "Hi", "top_p": 5})["code"] is None
    assert _refused(http_engine, "/v1/nowhere", {}, 404)["code"] is None
    assert _refused(http_engine, "/v1/completions", {"model": "nope", "prompt": "Hi"},
                    404)["code"] == "model_not_found"
    status, reply = http_engine.call(f"{http_engine.base_url}/v1/models", method="GET")
    assert status == 401 and reply["error"]["code"] == "invalid_api_key"


def _context(http_engine) -> int:
    status, models = http_engine.call(f"{http_engine.base_url}/v1/models", api_key=API_KEY,
                                      method="GET")
    assert status == 200
    return models["data"][0]["max_model_len"]


def test_a_huge_token_prompt_is_refused_by_its_length(http_engine):
    context = _context(http_engine)
    body = json.dumps({"model": http_engine.model, "prompt": [1] * 15_000_000,
                       "max_tokens": 4}).encode()  # 45 MB, under the 64 MiB body limit
    error = _refused(http_engine, "/v1/completions", body)
    assert error["param"] == "prompt"
    assert error["message"] == (f"prompt must be at most {context - 1} tokens (the "
                                f"{context}-token context keeps one for the output), got "
                                f"15000000 tokens")
    # Counted before any id is read: ids outside the vocabulary are not what is refused.
    error = _refused(http_engine, "/v1/completions",
                     {"model": http_engine.model, "prompt": [99_999_999] * (context + 1)})
    assert error["message"].startswith(f"prompt must be at most {context - 1} tokens")
    error = _refused(http_engine, "/v1/completions",
                     {"model": http_engine.model, "prompt": ["Hi", [99_999_999] * context]})
    assert error["param"] == "prompt[1]" and "context" in error["message"]
    # A pinned prefix may fill the context (the gRPC door's bound): one more is refused.
    error = _refused(http_engine, "/pin_prefix", {"tokens": [99_999_999] * (context + 1)})
    assert error["param"] == "tokens" and error["message"] == (
        f"tokens must be at most {context} tokens (the context), got {context + 1} tokens")
    error = _refused(http_engine, "/pin_prefix", {"tokens": [99_999_999] * context})
    assert "context" not in error["message"], error  # the engine's refusal: not in the vocabulary


def test_pin_prefix_names_tokens(http_engine):
    error = _refused(http_engine, "/pin_prefix", {"model": http_engine.model, "tokens": []})
    assert error["param"] == "tokens" and error["message"].startswith("tokens must"), error
