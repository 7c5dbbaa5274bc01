"""Function calling on the chat endpoint, as vLLM serves it without a tool-call parser: the
tools go to the chat template, and a call the client forces (tool_choice "required" or a named
function) is generated under the structured outputs constraint of the tools' schemas, so its
arguments always parse. The reply carries the calls as OpenAI's `tool_calls`.

"auto" (the model decides whether to call, in its own words) needs the model's call syntax
parsed out of free text, per model family: it is refused, naming tool_choice.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from openai_api.errors import bad_request
from openai_api.schemas import ChatCompletionRequest, NamedToolChoice, TokenizeRequest

# A forced call's arguments when its function declares no parameters: any JSON object.
ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True, slots=True)
class ForcedCalls:
    """How a forced request's completions become tool calls."""

    name: str | None  # a named function: each completion is its arguments; None: "required"
    schema: dict  # the output's JSON schema (the structured outputs constraint)


def tools_json(req: ChatCompletionRequest | TokenizeRequest) -> str:
    """The tools for the chat template (ChatMessages.tools_json); empty: none."""
    if not req.tools:
        return ""
    return json.dumps([tool.model_dump(exclude_none=True) for tool in req.tools])


def forced_calls(req: ChatCompletionRequest) -> ForcedCalls | None:
    """The calls tool_choice forces, or None (no tools, or "none"); a 400 naming tool_choice
    for "auto" with tools, and for a choice the tools cannot meet."""
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if req.tools else "none"
    if choice == "none":
        return None
    if not req.tools:
        if choice == "auto":
            return None  # nothing to call
        raise bad_request("tool_choice", f"tool_choice must be \"none\" or \"auto\" without "
                                         f"tools, got {_shown(choice)}: give tools")
    if choice == "auto":
        raise bad_request("tool_choice", 'tool_choice must be "none", "required" or a named '
                                         'function ({"type": "function", "function": {"name": '
                                         'NAME}}), got "auto" (the default with tools): this '
                                         'server does not parse calls out of free text; '
                                         '"required" lets the model pick the function')
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        for tool in req.tools:
            if tool.function.name == name:
                return ForcedCalls(name, _parameters(tool.function.parameters))
        names = ", ".join(json.dumps(t.function.name) for t in req.tools)
        raise bad_request("tool_choice.function.name",
                          f"tool_choice.function.name must name one of the tools ({names}), "
                          f"got {json.dumps(name)}")
    calls = {"type": "array", "minItems": 1, "items": {"anyOf": [{
        "type": "object",
        "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                       "parameters": _parameters(tool.function.parameters)},
        "required": ["name", "parameters"], "additionalProperties": False,
    } for tool in req.tools]}}
    if req.parallel_tool_calls is False:
        calls["maxItems"] = 1
    return ForcedCalls(None, calls)


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def required_calls(text: str) -> list[dict] | None:
    """A "required" completion's calls, as OpenAI's tool_calls (ids new); None when the text
    is not a whole list of calls (cut short by max_tokens)."""
    try:
        calls = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(calls, list) or not all(
            isinstance(c, dict) and isinstance(c.get("name"), str) and "parameters" in c
            for c in calls):
        return None
    return [call_json(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
            for c in calls]


def call_json(name: str, arguments: str, call_id: str | None = None) -> dict:
    return {"id": call_id or new_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _parameters(parameters: dict | None) -> dict:
    return ANY_OBJECT if parameters is None else parameters


def _shown(value: object) -> str:
    if isinstance(value, NamedToolChoice):
        return json.dumps(value.model_dump())
    return json.dumps(value)
