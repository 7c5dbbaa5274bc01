"""The request bodies the HTTP API accepts, one model per endpoint (OpenAI's fields, vLLM's
extensions), parsed strictly: a wrong type, an unknown field or a field we do not serve is a 400
naming it. What the values may be (ranges, limits) is the engine's validation's to say, once,
for gRPC and HTTP alike; only the wire types' ranges are checked here."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from openai_api.errors import ApiError, bad_request

Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]  # a seed on the wire
MAX_PROMPTS = 256  # prompts in one completions request: each is a request of its own
MAX_TOOLS = 128  # OpenAI's limit on a request's tools (and here, on a message's tool calls)
# A request body's bytes: parsing holds several times a body's size, and no prompt the engine
# takes comes near this (its own limit is 32 characters per context token).
MAX_BODY_BYTES = 64 << 20
# Fields of OpenAI's API (or vLLM's) this server does not serve, and the values that ask for
# nothing (clients send some of them by default): any other value is refused by name.
UNSERVED_FIELDS: dict[str, tuple[object, ...]] = {
    "echo": (False,), "suffix": ("",), "best_of": (), "tools": ([],),
    "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
    "parallel_tool_calls": (False, True),
    "store": (False,), "metadata": ({},), "modalities": (["text"],), "audio": (),
    "prediction": (), "reasoning_effort": (), "service_tier": ("auto", "default"),
    "web_search_options": (), "logits_processors": (),
    "guided_decoding_backend": (), "guided_whitespace_pattern": (),
    "chat_template": (), "documents": (),
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: usage in every chunk


class JsonSchemaFormat(_Strict):
    """OpenAI's response_format.json_schema; the output is held to `schema` whatever
    `strict` says (a grammar masks every step)."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's structured_outputs object: one of its fields."""

    json_: dict[str, Any] | bool | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class _Sampling(_Strict):
    """The fields both generation endpoints share."""

    model: str | None = None
    n: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, as OpenAI's is: for the caller's own tracking
    # vLLM's extensions
    top_k: Int32 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: Int32 | None = None
    stop_token_ids: list[Int32] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    cache_salt: str | None = None
    priority: Int32 | None = None
    use_beam_search: bool | None = None
    # top-k logprobs of each prompt token (vLLM's: [null, {token id: {logprob, rank,
    # decoded_token}}, ...]) per completions choice, or in a chat response
    prompt_logprobs: Int32 | None = None
    length_penalty: float | None = None
    allowed_token_ids: list[Int32] | None = None  # the only tokens the output may hold
    bad_words: list[str] | None = None  # words the output must not write
    truncate_prompt_tokens: Int32 | None = None  # the prompt's last this-many tokens run
    # Logprobs' tokens as "token_id:ID" (their ids, which text cannot always give back)
    return_tokens_as_token_ids: bool | None = None
    # OpenAI's: token id (a JSON object's key, so a string) -> bias in [-100, 100]
    logit_bias: dict[str, float] | None = None
    # Structured outputs: OpenAI's response_format, vLLM's guided_* and structured_outputs
    # (one constraint per request: to_engine.py).
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unserved(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, neutral in UNSERVED_FIELDS.items():
                if name not in data or name in cls.model_fields:  # (completions' echo)
                    continue
                value = data.pop(name)
                if value is None or value in neutral or (name == "best_of" and value in (
                        1, data.get("n"))):
                    continue
                raise unserved(name, value)
        return data


def unserved(name: str, value: object) -> ApiError:
    """The 400 for a field this server does not serve (UNSERVED_FIELDS), given a value that
    asks for something."""
    return bad_request(name, f"{name} is not supported by this server, got {_shown(value)}: "
                             "remove it")


class CompletionRequest(_Sampling):
    prompt: Any  # text, token ids, or a list of either: checked in to_engine.prompts
    max_tokens: Int32 | None = None
    logprobs: Int32 | None = None  # top-k logprobs per token, as OpenAI's legacy API
    echo: bool | None = None  # the prompt's text before each completion's


class TextPart(_Strict):
    type: Literal["text"]
    text: str


# Fields of OpenAI's chat messages, and the values that ask for nothing: a reply's message sent
# back as history (openai's message.model_dump()) carries them all, null. Other values are
# refused as unknown fields, by name.
EMPTY_MESSAGE_FIELDS: dict[str, tuple[object, ...]] = {
    "refusal": (None,), "annotations": (None, []), "audio": (None,),
    "function_call": (None,), "tool_calls": (None, []),
    "parsed": (None,),  # the openai package's structured-output reply (parse(), stream())
}


# OpenAI's rule for a function's name.
FunctionName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class FunctionDefinition(_Strict):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # accepted: forced calls are held to the schema either way


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    """tool_choice naming the one function the model must call."""

    type: Literal["function"]
    function: NamedFunction


class FunctionCall(_Strict):
    name: str
    arguments: str  # a JSON object's text, as the model wrote it
    # The openai package's own reading of `arguments` (a streamed reply's, sent back as
    # history): accepted, and not rendered (the arguments are).
    parsed_arguments: Any = None


class ToolCall(_Strict):
    """A call in an assistant message of the history."""

    id: str
    type: Literal["function"]
    function: FunctionCall
    index: Int32 | None = None  # a streamed call's (its deltas'): accepted, not rendered


class ChatMessage(_Strict):
    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool's answer: the call it answers
    # A participant's name (multi-agent clients such as AutoGen send it): accepted and not
    # rendered, as the chat templates of the models served here have no place for it.
    name: Annotated[str, StringConstraints(max_length=256)] | None = None
    # An assistant's thinking, as a reply with --reasoning-parser carries it (sent back as
    # history by the openai package): given to the template as reasoning_content.
    reasoning_content: str | None = None
    reasoning: str | None = None  # vLLM's newer name for it

    @model_validator(mode="before")
    @classmethod
    def _drop_empty_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, empty in EMPTY_MESSAGE_FIELDS.items():
                if name in data and any(data[name] == e for e in empty):
                    del data[name]
        return data


class _ChatTurn(_Strict):
    """vLLM's: whether the template opens the assistant's turn after the messages (unset:
    true, unless continuing), or ends inside the last one for the model to continue (e.g. an
    assistant's reply begun for it)."""

    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None


class ChatCompletionRequest(_Sampling, _ChatTurn):
    messages: list[ChatMessage]
    tools: list[Tool] | None = None
    # "auto" (the default with tools) reads calls out of the model's text (a server started
    # with --tool-call-parser; else a 400); "required" and a named function hold the output
    # to the tools' schemas.
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call
    # vLLM's: more variables for the chat template, e.g. {"enable_thinking": false} (Qwen3)
    chat_template_kwargs: dict[str, Any] | None = None
    max_tokens: Int32 | None = None  # deprecated by OpenAI, still sent by many clients
    max_completion_tokens: Int32 | None = None
    logprobs: bool | None = None
    top_logprobs: Int32 | None = None


class TokenizeRequest(_ChatTurn):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None  # given to the chat template, as chat gives them
    chat_template_kwargs: dict[str, Any] | None = None  # with messages, as chat's
    add_special_tokens: bool | None = None  # accepted: the engine tokenizes as Generate does


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[Int32]


class PinPrefixRequest(_ChatTurn):
    """POST /pin_prefix (pagedgen's own route, as /tokenize is vLLM's): the gRPC PinPrefix."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None  # with messages: given to the template, as chat gives them
    chat_template_kwargs: dict[str, Any] | None = None  # with messages, as chat's
    tokens: list[Int32] | None = None
    cache_salt: str | None = None
    ttl_s: float = 0.0  # 0: until unpinned
    unpin: bool = False


def check_message_count(body: bytes, limit: int) -> None:
    """A body's chat `messages` past `limit`, or its `tools` or a message's `tool_calls` past
    MAX_TOOLS, refused before pydantic builds a model per item (about 4 us each: half a
    million empty messages took 2 s, 400k tools 5.6 s). Each item is a JSON object (a tool or a
    call, two), and a structural '{' cannot be escaped: a body with fewer of them (the usual
    case) cannot hold too many, and the scan runs at C speed; otherwise the counts are read
    from the plain JSON parse, several times cheaper than the models."""
    if body.count(b"{") <= min(limit, 2 * MAX_TOOLS) + 1:
        return
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return  # not JSON, or nested past what json.loads takes: parse() refuses it (400)
    messages = data.get("messages") if isinstance(data, dict) else None
    if isinstance(messages, list) and len(messages) > limit:
        raise bad_request("messages", f"messages must hold at most {limit} messages, got "
                                      f"{len(messages)}")
    lists = [("tools", data.get("tools"))] if isinstance(data, dict) else []
    if isinstance(messages, list):
        lists += [(f"messages[{i}].tool_calls", m.get("tool_calls"))
                  for i, m in enumerate(messages) if isinstance(m, dict)]
    for name, items in lists:
        if isinstance(items, list) and len(items) > MAX_TOOLS:
            raise bad_request(name, f"{name} must hold at most {MAX_TOOLS} items, got "
                                    f"{len(items)}")


def parse(model: type[BaseModel], body: bytes) -> BaseModel:
    """`body` as `model`; a 400 naming the first field that is wrong."""
    try:
        return model.model_validate_json(body or b"null")
    except pydantic.ValidationError as error:
        raise _first_error(error, body) from None


def _first_error(error: pydantic.ValidationError, body: bytes) -> ApiError:
    first = error.errors(include_url=False)[0]
    cause = first.get("ctx", {}).get("error")
    if isinstance(cause, ApiError):  # our own refusal, raised inside a validator
        return cause
    if first["type"] == "json_invalid":
        return bad_request(None, f"the request body must be JSON: {first['msg']}")
    fields = [part for part in first["loc"] if not _is_union_tag(part)]
    field = _dotted(fields)
    kind = first["type"]
    if not fields:
        return bad_request(None, "the request body must be a JSON object")
    if kind == "missing":
        return bad_request(field, f"{field} is required")
    if kind == "extra_forbidden":
        return bad_request(field, f"{field} is not a field this server knows, got "
                                  f"{_shown(first['input'])}: remove it")
    if len(fields) < len(first["loc"]) and fields[-1] in _UNION_TYPES:
        # A union's first member failed: say what every member allows, with the whole value.
        whole = _walk(_loads(body), fields)
        return bad_request(field, f"{field} must be {_UNION_TYPES[fields[-1]]}, got "
                                  f"{_shown(whole)}")
    what = first["msg"].removeprefix("Input should be ").removeprefix("Input ")
    return bad_request(field, f"{field} must be {what}, got {_shown(first['input'])}")


_UNION_TYPES = {
    "tool_choice": '"none", "auto", "required" or {"type": "function", "function": {"name": '
                   'NAME}}',
    "stop": "a string or a list of strings",
    "content": 'a string or a list of text parts ({"type": "text", "text": "..."})',
}


def _is_union_tag(part: object) -> bool:
    return isinstance(part, str) and (part in ("str", "int", "float", "bool")
                                      or "[" in part or "-" in part)


def _walk(value: object, fields: list) -> object:
    for part in fields:
        try:
            value = value[part]
        except (KeyError, IndexError, TypeError):
            return None
    return value


def _dotted(loc: list) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _loads(body: bytes) -> object:
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None


def _shown(value: object, limit: int = 60) -> str:
    text = json.dumps(value) if not isinstance(value, bytes) else repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"
