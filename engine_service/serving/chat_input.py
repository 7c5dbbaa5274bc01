"""A wire chat (pb.ChatMessages) as the model's chat template takes it: the conversation, with
an assistant's tool calls and a tool's answers, the tools the model may call, and the request's
own template variables (chat_template_kwargs). The engine
and the router (which tokenizes chats to route by prefix) render a chat through here alike."""

from __future__ import annotations

import json

from engine_service.model.tokenizer import (
    chat_turn_error,
    encode_rendered_chat,
    render_chat,
    template_kwargs_error,
)
from pagedgen_api import generation_pb2 as pb


class ChatInputError(ValueError):
    """A chat field the template cannot be given; its message names the field."""


def chat_chars(chat: pb.ChatMessages) -> int:
    """Every character a chat gives the template: roles, contents, tool calls, the tools."""
    total = len(chat.tools_json) + len(chat.template_kwargs_json)
    for m in chat.messages:
        total += len(m.role) + len(m.content) + len(m.tool_call_id) + len(m.reasoning_content)
        total += sum(len(c.id) + len(c.name) + len(c.arguments) for c in m.tool_calls)
    return total


def chat_tools(chat: pb.ChatMessages) -> list[dict] | None:
    """The tools given to the template (None: none); ChatInputError when tools_json is not a
    JSON array of function tools, each named."""
    if not chat.tools_json:
        return None
    try:
        tools = json.loads(chat.tools_json)
    except (ValueError, RecursionError) as error:
        raise ChatInputError(f"chat.tools_json must be a JSON array of tools, got text that "
                             f"does not parse: {error}") from None
    if not isinstance(tools, list):
        raise ChatInputError(f"chat.tools_json must be a JSON array of tools, got a "
                             f"{type(tools).__name__}")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (not isinstance(tool, dict) or tool.get("type") != "function"
                or not isinstance(function, dict)
                or not isinstance(function.get("name"), str) or not function["name"]):
            raise ChatInputError(f'chat.tools_json[{i}] must be {{"type": "function", '
                                 f'"function": {{"name": NAME, ...}}}}, got '
                                 f"{json.dumps(tool)[:80]}")
    return tools


def chat_template_kwargs(chat: pb.ChatMessages) -> dict | None:
    """The template's extra variables (None: none); ChatInputError when template_kwargs_json
    is not a JSON object of names the server does not set itself."""
    if not chat.template_kwargs_json:
        return None
    field = "chat.template_kwargs_json"
    try:
        kwargs = json.loads(chat.template_kwargs_json)
    except (ValueError, RecursionError) as error:
        raise ChatInputError(f"{field} must be a JSON object of template variables, got text "
                             f"that does not parse: {error}") from None
    error = template_kwargs_error(kwargs, field)
    if error is not None:
        raise ChatInputError(error)
    return kwargs


def conversation(chat: pb.ChatMessages) -> list[dict]:
    """The messages as chat templates read them (transformers' form, render_chat makes each
    call's arguments an object), a tool's answer with the id of the call it answers."""
    out = []
    for m in chat.messages:
        message: dict = {"role": m.role, "content": m.content}
        if m.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.name, "arguments": c.arguments}} for c in m.tool_calls]
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        if m.reasoning_content:
            message["reasoning_content"] = m.reasoning_content
        out.append(message)
    return out


def chat_turn(chat: pb.ChatMessages) -> tuple[bool, bool]:
    """(add_generation_prompt, continue_final_message) as the template is given them: the
    first, unset, is true unless the last message is continued; ChatInputError when both are
    true."""
    add = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else None
    error = chat_turn_error(add, chat.continue_final_message, "chat.continue_final_message")
    if error is not None:
        raise ChatInputError(error)
    return (not chat.continue_final_message if add is None else add,
            chat.continue_final_message)


def render_wire_chat(tokenizer, chat: pb.ChatMessages) -> str:
    """The chat's template applied, ready for the assistant's turn (or in its last message)."""
    return render_chat(tokenizer, conversation(chat), chat_tools(chat),
                       chat_template_kwargs(chat), *chat_turn(chat))


def chat_token_ids(tokenizer, chat: pb.ChatMessages) -> list[int]:
    return encode_rendered_chat(tokenizer, render_wire_chat(tokenizer, chat))
