"""OpenAI request bodies -> the engine's wire request (pb.GenerateRequest), field by field.

The values are the servicer's to judge: it validates the GenerateRequest as it validates a
gRPC client's, and its refusals name the wire field, which `field_names` maps back to the
client's. Refused here: only OpenAI's own forms and combinations of fields, which the wire
has no place for (prompt forms, stream_options without a stream, ...).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from engine_service.model.sampling_params import MAX_LOGIT_BIAS
from engine_service.model.structured_outputs import MAX_SCHEMA_DEPTH
from engine_service.model.tokenizer import chat_turn_error, template_kwargs_error
from openai_api.errors import bad_request
from openai_api.reasoning_parsers import CONSTRAINED_OUTPUT_PARSER
from openai_api.schemas import (
    MAX_PROMPTS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    PinPrefixRequest,
    TokenizeRequest,
    _Sampling,
)
from openai_api.tool_calls import ForcedCalls, forced_calls, reads_calls, tools_json
from openai_api.tool_parsers import TAGS_MAY_BE_SPECIAL
from pagedgen_api import generation_pb2 as pb

# OpenAI's roles onto the chat template's; "developer" is OpenAI's newer name for "system".
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user",
              "assistant": "assistant", "tool": "tool"}


@dataclass(slots=True)
class EngineCall:
    """What one HTTP generation request asks of the engine, and how to answer it."""

    requests: list[pb.GenerateRequest]  # one per prompt, run concurrently
    field_names: list[dict[str, str]]  # per request: wire field -> the client's field
    n: int
    stream: bool
    include_usage: bool  # a last chunk with the usage (stream_options.include_usage)
    continuous_usage: bool  # usage in every chunk (vLLM's stream_options extension)
    # Completions: the top-k per token (OpenAI's integer). Chat: top_logprobs when logprobs.
    logprobs: int | None
    # Chat with neither max_tokens nor max_completion_tokens: OpenAI's default is the rest of
    # the context, which only the prompt's length tells (see rest_of_context).
    to_end_of_context: bool = False
    batch_prompt: bool = False  # the completions prompt was a list (choices by prompt)
    # Completions with echo: each request's prompt, its text or its token ids, to go before
    # its completions' text (None: no echo).
    echo_prompts: list[str | list[int]] | None = None
    # Echo with logprobs: the prompt tokens' logprobs go first, so each request goes as token
    # ids (a text prompt is tokenized first: nothing scores the first token, whose id only
    # the tokens tell). Echo with max_tokens 0: the prompt alone (one token is generated,
    # as vLLM does, and not returned).
    scores_prompt: bool = False
    echo_only: bool = False
    # vLLM's prompt_logprobs asked: each completions choice (a chat response) carries them.
    prompt_logprobs: bool = False
    # Chat whose tool_choice forces calls: how its completions become tool_calls.
    forced_calls: ForcedCalls | None = None
    # Chat with tools and tool_choice "auto": the parser that reads calls out of the text,
    # and whether the first call is the only one kept (parallel_tool_calls: false).
    tool_call_parser: str | None = None
    one_call: bool = False
    # A reasoning model's format (reasoning_parsers.py), for outputs nothing constrains.
    reasoning_parser: str | None = None
    constrained: bool = False  # held to a schema or grammar (structured outputs, forced calls)


def completion_call(req: CompletionRequest, request_id: str, max_model_len: int = 0,
                    longest_prompt: int = 0) -> EngineCall:
    """`max_model_len`: the served model's context (0: not known), which no token-id prompt
    may pass."""
    prompts, batch = _prompts(req.prompt, max_model_len,
                              kept_tokens(req.truncate_prompt_tokens, longest_prompt))
    echo_only = bool(req.echo) and req.max_tokens == 0
    if echo_only and req.min_tokens:
        raise bad_request("min_tokens", f"min_tokens must be 0 with max_tokens 0 (echo: the "
                                        f"prompt alone), got {req.min_tokens}")
    max_tokens = 1 if echo_only else req.max_tokens
    requests, names = [], []
    for i, prompt in enumerate(prompts):
        wire = _generate_request(req, f"{request_id}-{i}" if batch else request_id)
        if isinstance(prompt, str):
            wire.text = prompt
        else:
            wire.token_ids.ids.extend(prompt)
        constraint = _set_sampling(wire.sampling, req, max_tokens, req.logprobs)
        where = f"prompt[{i}]" if batch else "prompt"
        requests.append(wire)
        names.append(_field_names(where, "max_tokens", "logprobs", constraint))
        if req.echo and req.logprobs is not None:  # OpenAI's: the prompt's tokens' too
            if req.prompt_logprobs is not None:
                raise bad_request("prompt_logprobs", f"prompt_logprobs must be left unset with "
                                                     f"echo and logprobs (the prompt's come in "
                                                     f"logprobs), got {req.prompt_logprobs}")
            wire.sampling.prompt_logprobs = req.logprobs
            names[-1]["sampling.prompt_logprobs"] = "logprobs"
    call = _call(req, requests, names, req.logprobs, batch_prompt=batch)
    if req.echo:
        call.echo_prompts = prompts
        call.scores_prompt = req.logprobs is not None
        call.echo_only = echo_only
    return call


def chat_call(req: ChatCompletionRequest, request_id: str,
              tool_call_parser: str | None = None, reasoning_parser: str | None = None
              ) -> EngineCall:
    """`tool_call_parser`: how calls are read out of the model's text (tool_parsers.py) for
    tool_choice "auto"; None: "auto" with tools is refused. `reasoning_parser`: how the
    model's thinking is told from its answer (reasoning_parsers.py); where the output is held
    to a schema or grammar, only a reply that writes <think> thinks."""
    wire = _generate_request(req, request_id)
    wire.chat.CopyFrom(chat_messages(req.messages))
    wire.chat.tools_json = tools_json(req)
    wire.chat.template_kwargs_json = template_kwargs_json(req)
    set_chat_turn(wire.chat, req)
    forced = forced_calls(req, tool_call_parser is not None)
    if req.max_tokens is not None and req.max_completion_tokens is not None and (
            req.max_tokens != req.max_completion_tokens):
        raise bad_request("max_completion_tokens",
                          f"max_completion_tokens and max_tokens must agree when both are "
                          f"given, got {req.max_completion_tokens} and {req.max_tokens}")
    max_name = "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens"
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else (
        req.max_tokens)
    if req.stream and req.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs", f"prompt_logprobs must be left unset in a chat "
                                             f"stream (they come in a whole chat response), "
                                             f"got {req.prompt_logprobs}")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs",
                          f"top_logprobs needs logprobs: true, got top_logprobs "
                          f"{req.top_logprobs} with logprobs {_json(req.logprobs)}")
    top = (req.top_logprobs or 0) if req.logprobs else None
    constraint = _set_sampling(wire.sampling, req, max_tokens, top)
    if forced is not None:
        if constraint is not None:
            raise bad_request(constraint, f"{constraint} must be left unset when tool_choice "
                                          f"forces a call (the tools' schemas hold its "
                                          f"output), got one")
        wire.sampling.structured_outputs.json = json.dumps(forced.schema)
        constraint = "tools"  # (a schema that does not compile is a tool's parameters)
    call = _call(req, [wire], [_field_names("messages", max_name, "top_logprobs", constraint)],
                 top)
    call.to_end_of_context = max_tokens is None
    call.forced_calls = forced
    call.constrained = constraint is not None
    if reasoning_parser is not None:
        # Held to a schema or grammar, the output opens no thinking unless it writes <think>.
        call.reasoning_parser = (reasoning_parser if constraint is None
                                 else CONSTRAINED_OUTPUT_PARSER)
    if reads_calls(req) and tool_call_parser is not None:
        call.tool_call_parser = tool_call_parser
        call.one_call = req.parallel_tool_calls is False
        if tool_call_parser in TAGS_MAY_BE_SPECIAL and req.skip_special_tokens is None:
            # Hermes-2-Pro's tokenizer makes <tool_call> a special token: skipped, the calls
            # would leave the text unread (vLLM's hermes parser turns skipping off too).
            wire.sampling.skip_special_tokens = False
    return call


def template_kwargs_json(req: ChatCompletionRequest | TokenizeRequest | PinPrefixRequest
                         ) -> str:
    """chat_template_kwargs for the wire (ChatMessages.template_kwargs_json); empty: none. A
    400 for a name the server sets itself (tokenize, tools, ...)."""
    if not req.chat_template_kwargs:
        return ""
    error = template_kwargs_error(req.chat_template_kwargs, "chat_template_kwargs")
    if error is not None:
        raise bad_request("chat_template_kwargs", error)
    return json.dumps(req.chat_template_kwargs, ensure_ascii=False)


def set_chat_turn(chat: pb.ChatMessages,
                  req: ChatCompletionRequest | TokenizeRequest | PinPrefixRequest) -> None:
    """add_generation_prompt and continue_final_message onto the wire chat; a 400 for both."""
    error = chat_turn_error(req.add_generation_prompt, bool(req.continue_final_message))
    if error is not None:
        raise bad_request("continue_final_message", error)
    if req.add_generation_prompt is not None:
        chat.add_generation_prompt = req.add_generation_prompt
    chat.continue_final_message = bool(req.continue_final_message)


# The wire chat's fields the client names as they are (a refusal's field: errors.py).
CHAT_TURN_NAMES = {"chat.add_generation_prompt": "add_generation_prompt",
                   "chat.continue_final_message": "continue_final_message"}


def chat_messages(messages: list[ChatMessage], where: str = "messages") -> pb.ChatMessages:
    out = pb.ChatMessages()
    for i, message in enumerate(messages):
        role = CHAT_ROLES.get(message.role)
        if role is None:
            raise bad_request(f"{where}[{i}].role",
                              f"{where}[{i}].role must be one of {', '.join(CHAT_ROLES)}, got "
                              f"{_json(message.role)}")
        content = message.content
        if content is None:
            if role != "assistant":
                raise bad_request(f"{where}[{i}].content",
                                  f"{where}[{i}].content must be a string or text parts "
                                  f"(null only for an assistant), got null")
            content = ""
        elif not isinstance(content, str):  # text parts, joined as vLLM joins them
            content = "\n".join(part.text for part in content)
        wire = out.messages.add(role=role, content=content)
        if role == "tool" and message.tool_call_id is None:
            raise bad_request(f"{where}[{i}].tool_call_id",
                              f"{where}[{i}].tool_call_id must be set in a tool's message (the "
                              f"id of the call it answers), got none")
        if message.tool_calls:
            if role != "assistant":
                raise bad_request(f"{where}[{i}].tool_calls",
                                  f"{where}[{i}].tool_calls must be left unset in a "
                                  f"{message.role}'s message (an assistant's calls), got "
                                  f"{len(message.tool_calls)}")
            for call in message.tool_calls:
                wire.tool_calls.add(id=call.id, name=call.function.name,
                                    arguments=call.function.arguments)
        if message.tool_call_id is not None:
            wire.tool_call_id = message.tool_call_id
        thinking = message.reasoning_content or message.reasoning
        if thinking:
            if role != "assistant":
                name = "reasoning_content" if message.reasoning_content else "reasoning"
                raise bad_request(f"{where}[{i}].{name}",
                                  f"{where}[{i}].{name} must be left unset in a "
                                  f"{message.role}'s message (an assistant's thinking), got "
                                  f"{_json(thinking)}")
            wire.reasoning_content = thinking
    return out


def rest_of_context(request: pb.GenerateRequest, token_ids: list[int], longest_sequence: int
                    ) -> None:
    """A chat request without max_tokens, given its tokenized prompt: generate up to the end of
    the context (OpenAI's default) or what its sequences can hold of the KV pool
    (`longest_sequence`), sent as token ids so it is tokenized once."""
    request.token_ids.ids[:] = token_ids  # replaces the chat messages (the input oneof)
    request.sampling.max_tokens = max(1, longest_sequence - len(token_ids))


def _call(req: _Sampling, requests: list[pb.GenerateRequest], names: list[dict[str, str]],
          logprobs: int | None, batch_prompt: bool = False) -> EngineCall:
    options = req.stream_options
    if options is not None and not req.stream:
        raise bad_request("stream_options",
                          "stream_options is only allowed with stream: true, got stream "
                          f"{_json(req.stream)}")
    return EngineCall(
        requests=requests, field_names=names, n=1 if req.n is None else req.n,
        stream=bool(req.stream),
        include_usage=bool(options and (options.include_usage or options.continuous_usage_stats)),
        continuous_usage=bool(options and options.continuous_usage_stats),
        logprobs=logprobs, batch_prompt=batch_prompt,
        prompt_logprobs=req.prompt_logprobs is not None)


def _generate_request(req: _Sampling, request_id: str) -> pb.GenerateRequest:
    wire = pb.GenerateRequest(request_id=request_id)
    if req.cache_salt is not None:
        wire.cache_salt = req.cache_salt
    if req.priority is not None:
        wire.priority = req.priority
    return wire


def _set_sampling(s: pb.SamplingParams, req: _Sampling, max_tokens: int | None,
                  logprobs: int | None) -> str | None:
    """The one mapping of OpenAI's sampling fields (and vLLM's) onto SamplingParams; the
    client's name of the structured outputs constraint set, if any."""
    for name in ("n", "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty",
                 "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos",
                 "include_stop_str_in_output", "skip_special_tokens", "length_penalty",
                 "truncate_prompt_tokens"):
        value = getattr(req, name)
        if value is not None:
            setattr(s, name, value)
    if max_tokens is not None:
        s.max_tokens = max_tokens
    if logprobs is not None:
        s.logprobs = logprobs
    if req.prompt_logprobs is not None:
        s.prompt_logprobs = req.prompt_logprobs
    if req.stop is not None:
        s.stop.extend([req.stop] if isinstance(req.stop, str) else req.stop)
    if req.stop_token_ids:
        s.stop_token_ids.extend(req.stop_token_ids)
    if req.logit_bias:
        s.logit_bias.update(_logit_bias(req.logit_bias))
    if req.allowed_token_ids is not None:
        if not req.allowed_token_ids:  # (the wire cannot tell an empty list from none)
            raise bad_request("allowed_token_ids", "allowed_token_ids must hold at least one "
                                                   "token id (unset: any token), got []")
        s.allowed_token_ids.extend(req.allowed_token_ids)
    if req.bad_words:
        s.bad_words.extend(req.bad_words)
    if req.use_beam_search:  # vLLM's: n beams, the n best returned
        s.beam_width = s.n if s.HasField("n") else 1
    return _set_structured_outputs(s.structured_outputs, req)


def _set_structured_outputs(wire: pb.StructuredOutputs, req: _Sampling) -> str | None:
    """OpenAI's response_format, vLLM's guided_* fields and its structured_outputs object
    onto the one wire constraint (two of them at once are refused, naming both). Whether a
    schema, regex or grammar compiles is the engine's to say."""
    given: list[tuple[str, str, object]] = []  # (the client's field, kind, value)
    response_format = req.response_format
    if response_format is not None and response_format.type == "json_object":
        given.append(("response_format", "json_object", True))
    elif response_format is not None and response_format.type == "json_schema":
        if response_format.json_schema is None:
            raise bad_request("response_format.json_schema",
                              "response_format.json_schema must be set when type is "
                              "json_schema, got none")
        given.append(("response_format.json_schema.schema", "json",
                      response_format.json_schema.schema_))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                       ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        value = getattr(req, name)
        if value is not None:
            given.append((name, kind, value))
    if req.structured_outputs is not None:
        for kind in ("json", "json_object", "regex", "choice", "grammar"):
            value = getattr(req.structured_outputs, "json_" if kind == "json" else kind)
            if value is not None and value is not False:
                given.append((f"structured_outputs.{kind}", kind, value))
        if not given:
            raise bad_request("structured_outputs", "structured_outputs must set one of json, "
                                                    "json_object, regex, choice or grammar, "
                                                    "got none of them")
    if not given:
        return None
    if len(given) > 1:
        raise bad_request(given[1][0], f"{given[1][0]} and {given[0][0]} must not both be "
                                       f"set: one output constraint per request")
    name, kind, value = given[0]
    if kind == "json":
        # A schema's JSON text as sent; an object (or bool) re-encoded: order kept.
        try:
            wire.json = value if isinstance(value, str) else json.dumps(value)
        except RecursionError:  # the engine's limit is far below what json.dumps takes
            raise bad_request(name, f"{name} must nest objects and arrays at most "
                                    f"{MAX_SCHEMA_DEPTH} levels deep, got a deeper "
                                    f"schema") from None
    elif kind == "choice":
        wire.choice.values.extend(value)
    else:
        setattr(wire, kind, value)
    return name


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's logit_bias keys are token ids written as strings (JSON's keys), each id once:
    "5" and "05" would both be 5. The values' range is the engine's to check; the count is
    checked first, before a huge map is converted."""
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad_request("logit_bias", f"logit_bias must hold at most {MAX_LOGIT_BIAS} "
                                        f"entries, got {len(bias)}")
    ids = {}
    for key, value in bias.items():
        # Decimal digits without a leading zero, and few enough that int() is cheap.
        canonical = key.isascii() and key.isdecimal() and len(key) <= 10 and (
            key == "0" or not key.startswith("0"))
        token_id = int(key) if canonical else -1
        if not 0 <= token_id < 2**31:
            raise bad_request("logit_bias", f"logit_bias must map token ids (decimal strings "
                                            f"without leading zeros, below 2^31) to biases, "
                                            f"got the key {_json(key[:40])}")
        ids[token_id] = value
    return ids


def _field_names(prompt: str, max_tokens: str, logprobs: str,
                 constraint: str | None = None) -> dict[str, str]:
    names = {
        "input": prompt, "text": prompt, "token_ids.ids": prompt, "token_ids": prompt,
        "prompt": prompt, "prompt_token_ids": prompt, "chat.messages": prompt,
        "chat": prompt, "chat.tools_json": "tools",
        "chat.template_kwargs_json": "chat_template_kwargs", "sampling.max_tokens": max_tokens,
        "sampling.logprobs": logprobs,
        "sampling.prompt_logprobs": "prompt_logprobs",
        "sampling.beam_width": "n", "request": "request", **CHAT_TURN_NAMES,
    }
    if constraint is not None:  # the engine names structured_outputs and its kind
        for kind in ("", ".json", ".json_object", ".regex", ".choice", ".grammar"):
            names[f"sampling.structured_outputs{kind}"] = constraint
    return names


# A token-id prompt that truncate_prompt_tokens cuts may hold this many contexts of ids: each
# is checked before the cut (a malformed body is refused whatever is kept), and a body of
# millions held the event loop for seconds.
MAX_CUT_PROMPT_CONTEXTS = 16


def kept_tokens(truncate_prompt_tokens: int | None, longest_prompt: int) -> int | None:
    """How many of a prompt's last tokens truncate_prompt_tokens keeps (None: all, or -1
    with no served model known yet); `longest_prompt`: the most the engine runs
    (ServedModel.longest_prompt), -1's. A 400 for a value that keeps nothing."""
    keep = truncate_prompt_tokens
    if keep is None:
        return None
    if keep == 0 or keep < -1:
        raise bad_request("truncate_prompt_tokens",
                          f"truncate_prompt_tokens must be >= 1, -1 (the longest prompt the "
                          f"engine runs) or None, got {keep}")
    if keep == -1:
        return longest_prompt if longest_prompt > 0 else None
    return keep


def _prompts(prompt: object, max_model_len: int, kept: int | None = None
             ) -> tuple[list[str | list[int]], bool]:
    """OpenAI's prompt forms: a string, token ids, or a list of either; and whether it was a
    list of prompts. Token-id lists are counted before their ids are read one by one: a body
    of millions of ids (tens of MB, under the body limit) held the event loop, and every
    stream on it, for seconds. `kept`: truncate_prompt_tokens' count, which cuts token-id
    prompts first (a text prompt is cut once tokenized, by the engine)."""
    allowed = ("a string, a list of token ids (32-bit ints), or a list of strings or of "
               "token-id lists")
    if isinstance(prompt, str):
        return [prompt], False
    if not isinstance(prompt, list) or not prompt:
        raise bad_request("prompt", f"prompt must be {allowed}, got {_json(prompt)}")
    if _is_any_int(prompt[0]):  # token ids (a list of prompts starts with a string or list)
        if kept is not None:
            _check_ids_to_cut("prompt", prompt, max_model_len)
            prompt = prompt[-kept:]
        check_token_count("prompt", prompt, max_model_len)
        bad = next((p for p, t in enumerate(prompt) if not _is_int(t)), None)
        if bad is not None:
            raise bad_request("prompt", f"prompt must hold token ids (32-bit ints), got "
                                        f"{_json(prompt[bad])} at position {bad}")
        return [prompt], False
    if len(prompt) > MAX_PROMPTS:
        raise bad_request("prompt", f"prompt must hold at most {MAX_PROMPTS} prompts, got "
                                    f"{len(prompt)}")
    if kept is not None:
        for i, item in enumerate(prompt):
            if isinstance(item, list):
                _check_ids_to_cut(f"prompt[{i}]", item, max_model_len)
        prompt = [item[-kept:] if isinstance(item, list) else item for item in prompt]
    for i, item in enumerate(prompt):
        if isinstance(item, list):
            check_token_count(f"prompt[{i}]", item, max_model_len)
        if not (isinstance(item, str) or (isinstance(item, list)
                                          and all(_is_int(t) for t in item))):
            raise bad_request(f"prompt[{i}]", f"prompt[{i}] must be a string or a list of "
                                              f"token ids, got {_json(item)}")
    return list(prompt), True


def _check_ids_to_cut(where: str, ids: list, max_model_len: int) -> None:
    """A 400 unless a token-id prompt may be cut: at most MAX_CUT_PROMPT_CONTEXTS contexts of
    ids, each a token id >= 0, wherever it is. Whether a cut-off id is in the vocabulary is
    not asked: the engine checks those it runs."""
    limit = MAX_CUT_PROMPT_CONTEXTS * max_model_len
    if max_model_len and len(ids) > limit:
        raise bad_request(where, f"{where} must be at most {limit} tokens "
                                 f"({MAX_CUT_PROMPT_CONTEXTS} contexts) to be cut by "
                                 f"truncate_prompt_tokens, got {len(ids)} tokens")
    for position, token in enumerate(ids):
        if not _is_int(token) or token < 0:
            raise bad_request(where, f"{where} must hold token ids (32-bit ints >= 0), got "
                                     f"{_json(token)} at position {position}")


def check_token_count(where: str, ids: list, max_model_len: int,
                      for_output: bool = True) -> None:
    """The engine's own context check (its words), made before the ids are read (0: no
    context known yet). A prompt keeps one token of the context for its output; a pinned
    prefix may fill it."""
    if not max_model_len:
        return
    if for_output and len(ids) >= max_model_len:
        raise bad_request(where, f"{where} must be at most {max_model_len - 1} tokens (the "
                                 f"{max_model_len}-token context keeps one for the output), "
                                 f"got {len(ids)} tokens")
    if not for_output and len(ids) > max_model_len:
        raise bad_request(where, f"{where} must be at most {max_model_len} tokens (the "
                                 f"context), got {len(ids)} tokens")


def _is_any_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    """A token id the wire can carry (int32); which are in the vocabulary, the engine says."""
    return isinstance(value, int) and not isinstance(value, bool) and -(2**31) <= value < 2**31


def _json(value: object) -> str:
    import json

    text = json.dumps(value)
    return text if len(text) <= 60 else text[:60] + "..."
