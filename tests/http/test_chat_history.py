"""A reply's message sent back as history, as multi-turn clients do with the openai package's
`message.model_dump()`: its empty fields (refusal, annotations, audio, function_call,
tool_calls: null) ask for nothing and are accepted; a tool call in them is still refused by
name."""

from __future__ import annotations

import openai
import pytest

from tests.http.test_engine_errors import error_of


def test_a_dumped_reply_message_is_accepted_as_history(client, http_engine):
    first = [{"role": "user", "content": "Hello"}]
    reply = client.chat.completions.create(model=http_engine.model, messages=first,
                                           max_tokens=3, temperature=0)
    dumped = reply.choices[0].message.model_dump()
    assert dumped["refusal"] is None and dumped["tool_calls"] is None  # what clients send
    history = [*first, dumped, {"role": "user", "content": "And then?"}]
    again = client.chat.completions.create(model=http_engine.model, messages=history,
                                           max_tokens=3, temperature=0)
    assert again.choices[0].message.content
    plain = [*first, {"role": "assistant", "content": dumped["content"]}, history[-1]]
    same = client.chat.completions.create(model=http_engine.model, messages=plain,
                                          max_tokens=3, temperature=0)
    assert again.usage.prompt_tokens == same.usage.prompt_tokens  # the same prompt

    called = {**dumped, "tool_calls": [{"id": "1", "type": "function",
                                        "function": {"name": "f", "arguments": "{}"}}]}
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=http_engine.model, max_tokens=3,
                                       messages=[*first, called, history[-1]])
    assert error_of(raised)["param"] == "messages[1].tool_calls"
