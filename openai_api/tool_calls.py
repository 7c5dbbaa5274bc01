"""Function calling on the chat endpoint: the tools go to the chat template, and a call the
client forces (tool_choice "required" or a named function) is generated under the structured
outputs constraint of the tools' schemas, so its arguments always parse. The reply carries the
calls as OpenAI's `tool_calls`.

"auto" (the model decides whether to call, in its own words) needs the model's call syntax
read out of its text, per model family (tool_parsers.py, --tool-call-parser): without a
parser it is refused, naming tool_choice.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from openai_api.errors import bad_request
from openai_api.schemas import (
    ChatCompletionRequest,
    NamedToolChoice,
    PinPrefixRequest,
    TokenizeRequest,
)

# A forced call's arguments when its function declares no parameters: any JSON object.
ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True, slots=True)
class ForcedCalls:
    """How a forced request's completions become tool calls."""

    name: str | None  # a named function: each completion is its arguments; None: "required"
    schema: dict  # the output's JSON schema (the structured outputs constraint)


def tools_json(req: ChatCompletionRequest | TokenizeRequest | PinPrefixRequest) -> str:
    """The tools for the chat template (ChatMessages.tools_json); empty: none. A 400 for two
    tools of one name (a call could not say which it is)."""
    if not req.tools:
        return ""
    seen = set()
    for i, tool in enumerate(req.tools):
        name = tool.function.name
        if name in seen:
            raise bad_request(f"tools[{i}].function.name",
                              f"tools[{i}].function.name must differ from the other tools' "
                              f"names, got {json.dumps(name)} again")
        seen.add(name)
    # (not ASCII-escaped: the characters counted against the prompt's limit are the client's)
    return json.dumps([tool.model_dump(exclude_none=True) for tool in req.tools],
                      ensure_ascii=False)


def reads_calls(req: ChatCompletionRequest) -> bool:
    """tool_choice "auto" with tools (the default): calls are read out of the model's text."""
    return bool(req.tools) and req.tool_choice in (None, "auto")


def forced_calls(req: ChatCompletionRequest, reads_text: bool = False) -> ForcedCalls | None:
    """The calls tool_choice forces, or None (no tools, "none", or "auto"); a 400 naming
    tool_choice for a choice the tools cannot meet, and for "auto" with tools when this
    server reads no calls out of text (`reads_text`: --tool-call-parser)."""
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
        if reads_text:
            return None
        raise bad_request("tool_choice", 'tool_choice must be "none", "required" or a named '
                                         'function ({"type": "function", "function": {"name": '
                                         'NAME}}), got "auto" (the default with tools): this '
                                         'server reads no calls out of free text (start it '
                                         'with --tool-call-parser for the model\'s format); '
                                         '"required" lets the model pick the function')
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        for i, tool in enumerate(req.tools):
            if tool.function.name == name:
                return ForcedCalls(name, _parameters(i, tool.function.parameters))
        names = ", ".join(json.dumps(t.function.name) for t in req.tools[:8])
        more = f" and {len(req.tools) - 8} more" if len(req.tools) > 8 else ""
        raise bad_request("tool_choice.function.name",
                          f"tool_choice.function.name must name one of the tools ({names}"
                          f"{more}), got {json.dumps(name[:80])}")
    # Each tool's schema goes one level down, under its call's "parameters": its local
    # definitions ($defs, definitions) go up to the whole schema's root, where its "#/$defs/..."
    # references then point (pydantic's and zod's schemas use them).
    definitions: dict[str, dict] = {"$defs": {}, "definitions": {}}
    alternatives = []
    for i, tool in enumerate(req.tools):
        parameters = dict(_parameters(i, tool.function.parameters))
        for key, found in definitions.items():
            for name, schema in (parameters.pop(key, None) or {}).items():
                if found.get(name, schema) != schema:
                    raise bad_request(f"tools[{i}].function.parameters.{key}",
                                      f"tools[{i}].function.parameters.{key}.{name} must be "
                                      f"the same as another tool's {key}.{name} when "
                                      f"tool_choice is \"required\" (their definitions are "
                                      f"shared), got a different schema")
                found[name] = schema
        alternatives.append({
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                           "parameters": parameters},
            "required": ["name", "parameters"], "additionalProperties": False,
        })
    calls = {"type": "array", "minItems": 1, "items": {"anyOf": alternatives}}
    if req.parallel_tool_calls is False:
        calls["maxItems"] = 1
    calls.update({key: found for key, found in definitions.items() if found})
    return ForcedCalls(None, calls)


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def required_calls(text: str) -> list[dict] | None:
    """A "required" completion's calls, as OpenAI's tool_calls (ids new), each call's
    arguments the text the model wrote (not re-encoded: its numbers stay as written); None
    when the text is not a whole list of calls (cut short by max_tokens)."""
    try:
        calls = json.loads(text)
        raw = _raw_items(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(calls, list) or not all(
            isinstance(c, dict) and isinstance(c.get("name"), str) and "parameters" in c
            for c in calls) or not calls:
        return None
    return [call_json(c["name"], r["parameters"]) for c, r in zip(calls, raw, strict=True)]


def _raw_items(text: str) -> list[dict[str, str]]:
    """A JSON array of objects' members as their values' own text, by key (ValueError when
    the text is not that)."""
    items, at = [], _skip(text, 0, "[")
    while text[at] != "]":
        members, end = raw_members(text, at)
        items.append(members)
        at = _skip(text, end)
        if text[at] == ",":
            at = _skip(text, at, ",")
    return items


def raw_members(text: str, at: int = 0) -> tuple[dict[str, str], int]:
    """The JSON object at `at`: its members' values as their own text (as the model wrote
    them), by key, and where the object ends; ValueError when there is none."""
    decode = json.JSONDecoder().raw_decode
    at, members = _skip(text, at, "{"), {}
    while text[at] != "}":
        key, at = decode(text, at)
        at = _skip(text, at, ":")
        _, end = decode(text, at)
        members[key], at = text[at:end], _skip(text, end)
        if text[at] == ",":
            at = _skip(text, at, ",")
    return members, at + 1


def _skip(text: str, at: int, expected: str = "") -> int:
    """Past `expected` (when given: it must be next) and the whitespace after it."""
    while at < len(text) and text[at].isspace():
        at += 1
    if expected:
        if not text.startswith(expected, at):
            raise ValueError(f"expected {expected!r} at {at}")
        at += len(expected)
    while at < len(text) and text[at].isspace():
        at += 1
    if at >= len(text):
        raise ValueError("the text ended")
    return at


def call_json(name: str, arguments: str, call_id: str | None = None) -> dict:
    return {"id": call_id or new_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _parameters(index: int, parameters: dict | None) -> dict:
    """A function's arguments schema: an object's (a call's arguments are one, as OpenAI's
    are); none or {} allows any object."""
    if not parameters:
        return ANY_OBJECT
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise bad_request(f"tools[{index}].function.parameters",
                          f"tools[{index}].function.parameters must be the JSON Schema of an "
                          f"object (type \"object\"), got type "
                          f"{json.dumps(parameters.get('type'))}")
    return parameters


def _shown(value: object) -> str:
    if isinstance(value, NamedToolChoice):
        return json.dumps(value.model_dump())
    return json.dumps(value)
