"""A reply's message sent back as history, as multi-turn clients do with the openai package's
`message.model_dump()`: its empty fields (refusal, annotations, audio, function_call,
tool_calls: null) ask for nothing and are accepted, and so is a tool call with its answer."""

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

    # A call in the history is the template's to write (test_tool_templates.py); this one's
    # has no place for it.
    called = {**dumped, "tool_calls": [{"id": "1", "type": "function",
                                        "function": {"name": "f", "arguments": "{}"}}]}
    answered = [*first, called, {"role": "tool", "tool_call_id": "1", "content": "done"}]
    reply = client.chat.completions.create(model=http_engine.model, max_tokens=3,
                                           messages=answered, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_a_message_name_is_accepted_and_not_rendered(client, http_engine):
    """Multi-agent clients name the participants (`name`): accepted, the prompt unchanged
    (the served templates have no place for it); past 256 characters it is refused by name."""
    plain = [{"role": "user", "content": "Hello"}]
    named = [{"role": "user", "content": "Hello", "name": "planner"}]
    replies = [client.chat.completions.create(model=http_engine.model, messages=m,
                                              max_tokens=3, temperature=0)
               for m in (plain, named)]
    assert replies[0].usage.prompt_tokens == replies[1].usage.prompt_tokens
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=http_engine.model, max_tokens=3,
                                       messages=[{**named[0], "name": "x" * 257}])
    assert error_of(raised)["param"] == "messages[0].name"
