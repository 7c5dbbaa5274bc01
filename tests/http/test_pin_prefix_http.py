"""POST /pin_prefix (issue 34): PinPrefix over HTTP on an engine without the prefix index —
the prefix computed and pinned, the first completion with it finds it cached; refusals name the
client's field; no key, no pin."""

from __future__ import annotations

import pytest

from tests.http.conftest import API_KEY

BLOCK = 16
HOT = list(range(7000, 7000 + 3 * BLOCK + 5))  # 3 full blocks


def test_pin_prefix_then_the_first_completion_finds_it_cached(http_engine, client):
    url = f"{http_engine.base_url}/pin_prefix"
    status, body = http_engine.call(url, {"tokens": HOT, "ttl_s": 120}, API_KEY)
    assert (status, body) == (200, {"num_blocks": 3, "num_pinned": 3})
    completion = client.completions.create(model=http_engine.model, prompt=HOT, max_tokens=1,
                                           temperature=0)
    assert completion.usage.prompt_tokens_details.cached_tokens == 3 * BLOCK
    status, body = http_engine.call(url, {"tokens": HOT, "unpin": True}, API_KEY)
    assert (status, body) == (200, {"num_blocks": 3, "num_pinned": 3})


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"tokens": HOT[:10]}, "tokens",
     "tokens must hold at least one full block (16 tokens) to pin, got 10 tokens"),
    ({"tokens": HOT, "ttl_s": -1}, "ttl_s", "ttl_s must be in [0, 2592000] seconds"),
    ({"tokens": HOT, "prompt": "hi"}, "prompt",
     "give exactly one of prompt (text), messages (chat) or tokens, got prompt and tokens"),
    ({}, "prompt", "give exactly one of prompt (text), messages (chat) or tokens, got none"),
])
def test_pin_prefix_refusals_name_the_field(http_engine, body, param, message):
    status, reply = http_engine.call(f"{http_engine.base_url}/pin_prefix", body, API_KEY)
    assert status == 400, reply
    assert reply["error"]["param"] == param
    assert reply["error"]["message"].startswith(message), reply


def test_pin_prefix_needs_the_key(http_engine):
    status, reply = http_engine.call(f"{http_engine.base_url}/pin_prefix", {"tokens": HOT})
    assert status == 401 and "num_pinned" not in reply
