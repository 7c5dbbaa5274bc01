"""Function calling on /v1/chat/completions with the official `openai` client: a named function
or "required" is generated under the tools' schemas and comes back as tool_calls (whole, and
streamed as OpenAI's deltas, the same calls); "auto" and choices the tools cannot meet are
400s naming the field. (What the template is given: test_tool_templates.py.)"""

from __future__ import annotations

import json

import openai
import pytest

from openai_api.schemas import ChatCompletionRequest
from openai_api.tool_calls import forced_calls, required_calls
from tests.http.conftest import API_KEY
from tests.http.test_engine_errors import error_of

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris for two days?"}]


def weather_arguments(text: str) -> dict:
    arguments = json.loads(text)
    assert set(arguments) == {"city", "days"}, arguments
    assert arguments["city"] in ("Paris", "Rome", "Oslo") and 1 <= arguments["days"] <= 7
    return arguments


def streamed_calls(chunks) -> tuple[dict[int, dict], list[str | None]]:
    """A stream's tool calls assembled from their deltas as OpenAI's clients do (by index:
    the id, type and name once, the arguments in pieces), and each choice's finish."""
    calls: dict[int, dict] = {}
    finishes = []
    for chunk in chunks:
        for choice in chunk.choices:
            assert choice.index == 0
            for delta in choice.delta.tool_calls or ():
                call = calls.setdefault(delta.index, {"arguments": ""})
                if delta.id is not None:
                    assert "id" not in call  # once per call
                    call["id"], call["type"] = delta.id, delta.type
                    call["name"] = delta.function.name
                call["arguments"] += delta.function.arguments or ""
            if choice.finish_reason is not None:
                finishes.append(choice.finish_reason)
    return calls, finishes


def test_a_named_function_is_called_with_arguments_its_schema_allows(client, http_engine):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(
        model=http_engine.model, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
        max_tokens=60, temperature=0)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "stop"  # (OpenAI's, for a call it was told to make)
    assert message.content is None and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("chatcmpl-tool-")
    whole = weather_arguments(call.function.arguments)

    stream = client.chat.completions.create(
        model=http_engine.model, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
        max_tokens=60, temperature=0, stream=True)
    calls, finishes = streamed_calls(stream)
    assert finishes == ["stop"]
    assert list(calls) == [0] and calls[0]["name"] == "get_weather"
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("chatcmpl-tool-")
    assert json.loads(calls[0]["arguments"]) == whole  # greedy: the same call


def test_required_calls_keep_the_arguments_as_the_model_wrote_them():
    """Re-encoded, 1e999 became Infinity (not JSON) and 1.50 became 1.5."""
    text = ('[{"name": "f", "parameters": {"x": 1e999, "y": 1.50}}, '
            '{"name":"g","parameters":{"a": [1, {"b": "}"}]}}]')
    calls = required_calls(text)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("f", '{"x": 1e999, "y": 1.50}'), ("g", '{"a": [1, {"b": "}"}]}')]
    for cut in ('[{"name": "f", "parameters": {"x": 1}}', "[]", '[{"name": "f"}]'):
        assert required_calls(cut) is None


@pytest.mark.parametrize("parameters", [None, {}])
def test_a_function_without_parameters_is_held_to_an_object(parameters):
    """A call's arguments are an object (clients call fn(**arguments)): a function with no
    parameters schema, or {}, is called with any object, not any JSON value."""
    function = {"name": "ping"} | ({} if parameters is None else {"parameters": parameters})
    for choice in ({"type": "function", "function": {"name": "ping"}}, "required"):
        req = ChatCompletionRequest.model_validate({
            "messages": ASK, "tools": [{"type": "function", "function": function}],
            "tool_choice": choice})
        schema = forced_calls(req).schema
        if choice == "required":
            schema = schema["items"]["anyOf"][0]["properties"]["parameters"]
        assert schema == {"type": "object"}


def test_required_calls_one_or_more_of_the_tools(client, http_engine):
    reply = client.chat.completions.create(
        model=http_engine.model, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
        max_tokens=120, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.function.name in ("get_weather", "get_time")
        if call.function.name == "get_weather":
            weather_arguments(call.function.arguments)
        else:
            assert json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    assert len({call.id for call in choice.message.tool_calls}) == len(choice.message.tool_calls)

    stream = client.chat.completions.create(
        model=http_engine.model, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
        max_tokens=120, temperature=0, stream=True)
    calls, finishes = streamed_calls(stream)
    assert finishes == ["tool_calls"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]

    one = client.chat.completions.create(
        model=http_engine.model, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
        parallel_tool_calls=False, max_tokens=120, temperature=0.8, seed=3, n=3)
    for choice in one.choices:
        assert len(choice.message.tool_calls or ()) == 1 or choice.finish_reason == "length"


def test_required_takes_tools_whose_schemas_use_local_definitions(client, http_engine):
    """pydantic's schemas (the openai package's pydantic_function_tool) put nested models in
    $defs: under "required" each tool's schema goes one level down, and its definitions go to
    the root with it, where its references point."""
    located = {"type": "function", "function": {"name": "locate", "parameters": {
        "type": "object", "properties": {"place": {"$ref": "#/$defs/Place"}},
        "required": ["place"], "additionalProperties": False,
        "$defs": {"Place": {"type": "object", "properties": {
            "city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"], "additionalProperties": False}}}}}
    reply = client.chat.completions.create(
        model=http_engine.model, messages=ASK, tools=[located, WEATHER],
        tool_choice="required", parallel_tool_calls=False, max_tokens=120, temperature=0)
    [call] = reply.choices[0].message.tool_calls
    if call.function.name == "locate":
        assert json.loads(call.function.arguments)["place"]["city"] in ("Paris", "Rome")
    else:
        weather_arguments(call.function.arguments)


def test_a_streamed_reply_sent_back_as_history_is_accepted(client, http_engine):
    """The openai package's stream helper builds the message with what its deltas carried
    (each call's index, its parsed arguments): sent back as history, as agent loops do."""
    choice = {"type": "function", "function": {"name": "get_weather"}}
    with client.chat.completions.stream(model=http_engine.model, messages=ASK, tools=[WEATHER],
                                        tool_choice=choice, max_tokens=60,
                                        temperature=0) as stream:
        for _ in stream:
            pass
        message = stream.get_final_completion().choices[0].message
    assert message.content is None  # (null in the stream's role chunk too)
    history = [*ASK, message.model_dump(),
               {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny"}]
    assert "index" in history[1]["tool_calls"][0]  # what the package sends back
    reply = client.chat.completions.create(model=http_engine.model, messages=history,
                                           max_tokens=3, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_more_than_128_tools_or_calls_are_refused_before_they_are_read(http_engine):
    many = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]
    status, reply = http_engine.call(f"{http_engine.base_url}/v1/chat/completions", {
        "model": http_engine.model, "messages": ASK, "tools": many, "tool_choice": "none"},
        api_key=API_KEY)
    assert status == 400 and reply["error"]["param"] == "tools", reply
    assert "at most 128 items, got 129" in reply["error"]["message"]
    calls = [{"id": str(i), "type": "function", "function": {"name": "f", "arguments": "{}"}}
             for i in range(129)]
    status, reply = http_engine.call(f"{http_engine.base_url}/tokenize", {
        "model": http_engine.model,
        "messages": [*ASK, {"role": "assistant", "tool_calls": calls}]}, api_key=API_KEY)
    assert status == 400 and reply["error"]["param"] == "messages[1].tool_calls", reply


@pytest.mark.parametrize(("route", "body", "param"), [
    ("/tokenize", {"prompt": "x", "tools": [WEATHER]}, "tools"),
    ("/pin_prefix", {"prompt": "x", "tools": [WEATHER]}, "tools"),
    ("/pin_prefix", {"messages": ASK, "tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
])
def test_tools_go_with_messages_alone(http_engine, route, body, param):
    status, reply = http_engine.call(f"{http_engine.base_url}{route}",
                                     {"model": http_engine.model, **body}, api_key=API_KEY)
    assert status == 400 and reply["error"]["param"] == param, reply


@pytest.mark.parametrize(("kwargs", "param", "words"), [
    ({"tools": [WEATHER]}, "tool_choice", '"auto" (the default with tools)'),
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", "free text"),
    ({"tool_choice": "required"}, "tool_choice", "without tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", 'one of the tools ("get_weather")'),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", '"required" or'),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "must be left unset when tool_choice forces a call"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}],
      "tool_choice": "required"}, "tools[0].function.name", "should match pattern"),
    ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"$ref": "#/x"}}}}}],
      "tool_choice": "required"}, "tools", ""),
    ({"messages": [{"role": "developer", "content": "hi", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages[0].tool_calls", "unset in a developer's message (an assistant's calls)"),
    ({"messages": [*ASK, {"role": "tool", "content": "sunny"}]}, "messages[1].tool_call_id",
     "must be set in a tool's message"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "none"}, "tools[1].function.name",
     'must differ from the other tools\' names, got "get_weather" again'),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string"}}}], "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tools[0].function.parameters", 'must be the JSON Schema of an object (type "object")'),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "$defs": {"A": {"type": "integer"}}}}},
                {"type": "function", "function": {"name": "g", "parameters": {
                    "type": "object", "$defs": {"A": {"type": "string"}}}}}],
      "tool_choice": "required"}, "tools[1].function.parameters.$defs",
     "$defs.A must be the same as another tool's"),
])
def test_tool_choices_the_server_cannot_meet_are_400s_naming_the_field(
        client, http_engine, kwargs, param, words):
    body = {"model": http_engine.model, "messages": ASK, "max_tokens": 8, **kwargs}
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(**body)
    error = error_of(raised)
    assert error["param"] == param, error
    assert words in error["message"], error


def test_tools_on_completions_are_still_refused(client, http_engine):
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=http_engine.model, prompt="x", max_tokens=2,
                                  extra_body={"tools": [WEATHER]})
    assert error_of(raised)["param"] == "tools"
