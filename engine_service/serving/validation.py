"""Every check on a client's request, in one place, each mapped to a gRPC status code.

Messages read "<field> must be <allowed>, got <value>" so a user can act on them. What the wire
format alone decides (the input oneof, chat roles, the request id's shape) is checked here and
refused with RequestRejected; what the engine decides (context, pool, vocabulary) it checks
itself and raises typed errors (engine_service/core/errors.py). engine_service/serving/status.py
maps both to status codes.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from engine_service.core.errors import DuplicateRequestError, QueueFullError
from engine_service.core.request_limits import RequestLimits, truncated_prompt
from engine_service.model.sampling_params import SamplingParams
from engine_service.model.tokenizer import (
    FinalMessageError,
    encode_rendered_chat,
    encode_text,
    render_chat,
)
from engine_service.serving.chat_input import (
    ChatInputError,
    chat_chars,
    chat_template_kwargs,
    chat_tools,
    chat_turn,
    conversation,
)
from engine_service.serving.status import RequestRejected
from pagedgen_api import generation_pb2 as pb

CHAT_ROLES = ("system", "user", "assistant", "tool")
REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
MAX_CACHE_SALT_CHARS = 256
MAX_CHAT_MESSAGES = 256
MAX_TTL_S = 30 * 24 * 3600.0
# A token is rarely more than a few characters; more characters than this per context token
# can never fit, and refusing them early keeps us from tokenizing megabytes.
CHARS_PER_CONTEXT_TOKEN = 32
_SAMPLING_FIELDS = (
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "max_tokens", "min_tokens", "ignore_eos",
    "logprobs", "include_stop_str_in_output", "skip_special_tokens", "beam_width",
    "length_penalty", "prompt_logprobs", "truncate_prompt_tokens",
)
EARLY_STOPPING = {
    pb.EARLY_STOPPING_FALSE: False,
    pb.EARLY_STOPPING_TRUE: True,
    pb.EARLY_STOPPING_NEVER: "never",
}




def check_chat_size(chat: pb.ChatMessages, max_chars: int) -> None:
    """A chat's message count, then its characters in all (every field of every message, and
    the tools), before anything else reads it: rendering a template costs time per message,
    so a chat of half a million empty messages must be refused here, at once. Also the
    router's check."""
    messages = chat.messages
    if len(messages) > MAX_CHAT_MESSAGES:
        raise _invalid(
            f"chat.messages must hold at most {MAX_CHAT_MESSAGES} messages, got {len(messages)}"
        )
    total_chars = chat_chars(chat)
    if total_chars > max_chars:
        raise _invalid(
            f"chat.messages must hold at most {max_chars} characters in all (roles, contents, "
            f"tool calls and tools), got {total_chars}"
        )


def check_text_size(text: str, max_chars: int) -> None:
    if len(text) > max_chars:
        raise _invalid(f"text must be at most {max_chars} characters, got {len(text)}")


def _invalid(message: str) -> RequestRejected:
    return RequestRejected(grpc.StatusCode.INVALID_ARGUMENT, message)


def _shown(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(str(value))} chars)"


@dataclass(slots=True)
class Prompt:
    token_ids: list[int]
    text: str | None  # the text that was tokenized (rendered template for chat), if any


@dataclass(slots=True)
class ValidRequest:
    request_id: str
    prompt: Prompt
    params: SamplingParams
    cache_salt: str | None
    priority: int


class RequestValidator:
    """Checks requests against one engine (its vocabulary, context and pool).

    `tokenizer` is the servicer's own copy: the engine thread uses the engine's, and HF fast
    tokenizers must not be used from two threads at once."""

    def __init__(self, limits: RequestLimits, tokenizer, max_live_requests: int) -> None:
        self.limits = limits
        self.tokenizer = tokenizer
        self.vocab_size = limits.vocab_size
        self.max_prompt_chars = CHARS_PER_CONTEXT_TOKEN * limits.max_model_len
        self.max_live_requests = max_live_requests

    # ---- Generate / GenerateStream --------------------------------------------------------
    def generate(
        self, req: pb.GenerateRequest, is_live: Callable[[str], bool], num_live: int,
        prompt: Prompt | None = None,
    ) -> ValidRequest:
        """`prompt`: the request's input already tokenized (elsewhere: a long one), else
        tokenized here."""
        request_id = req.request_id or uuid.uuid4().hex
        if not REQUEST_ID_PATTERN.fullmatch(request_id):
            raise _invalid(
                f"request_id must be 1 to 128 characters of [A-Za-z0-9._:-] (or empty for a "
                f"generated one), got {_shown(request_id)}"
            )
        cache_salt = self.cache_salt(req.cache_salt)
        if prompt is None:
            prompt = self.prompt(req, "input")
        params = self.sampling_params(req.sampling)
        kept = truncated_prompt(prompt.token_ids, params, self.limits)
        if kept is not prompt.token_ids:  # (the text stays the client's whole prompt)
            prompt = Prompt(kept, prompt.text)
        self.check_fits(prompt.token_ids, params)
        if is_live(request_id):
            raise DuplicateRequestError(
                "request_id", f"request_id must be unique among live requests, got {request_id!r}"
            )
        if num_live >= self.max_live_requests:
            raise QueueFullError(
                "request",
                f"live requests must be at most {self.max_live_requests} (the queue limit), "
                f"got {num_live + 1}: retry later",
            )
        return ValidRequest(request_id, prompt, params, cache_salt, req.priority)

    def cache_salt(self, salt: str) -> str | None:
        if len(salt) > MAX_CACHE_SALT_CHARS:
            raise _invalid(
                f"cache_salt must be at most {MAX_CACHE_SALT_CHARS} characters, "
                f"got {len(salt)}"
            )
        return salt or None

    def check_fits(self, token_ids: list[int], params: SamplingParams) -> None:
        """The engine's own checks (context, pool, vocabulary): reads only its fixed limits,
        so it is safe on the event loop thread; raises the engine's typed errors."""
        self.limits.validate(token_ids, params)

    # ---- prompts --------------------------------------------------------------------------
    def prompt(self, req, oneof: str) -> Prompt:
        """The token ids of a request's `text` | `token_ids` | `chat` input."""
        which = req.WhichOneof(oneof)
        if which is None:  # the request's own choices (Tokenize has no token_ids)
            names = [f.name for f in req.DESCRIPTOR.oneofs_by_name[oneof].fields]
            raise _invalid(f"{oneof} must be one of {', '.join(names[:-1])} or {names[-1]}, "
                           f"got none of them")
        if which == "text":
            return self.text_prompt(req.text)
        if which == "token_ids":
            return Prompt(self.token_ids("token_ids.ids", req.token_ids.ids), None)
        return self.chat_prompt(req.chat)

    def need_tokenizer(self, what: str) -> None:
        if self.tokenizer is None:
            raise _invalid(
                f"{what} needs a tokenizer, but this engine serves token ids only "
                f"(--skip-tokenizer-init): send token_ids"
            )

    def text_prompt(self, text: str) -> Prompt:
        self.need_tokenizer("text input")
        if not text:
            raise _invalid("text must be a non-empty string, got ''")
        check_text_size(text, self.max_prompt_chars)
        return Prompt(encode_text(self.tokenizer, text), text)

    def token_ids(self, field: str, ids, allow_empty: bool = False) -> list[int]:
        if not ids and not allow_empty:
            raise _invalid(f"{field} must hold at least one token id, got []")
        for position, token_id in enumerate(ids):
            if not 0 <= token_id < self.vocab_size:
                raise _invalid(
                    f"{field} must be in [0, {self.vocab_size}) (the vocabulary), "
                    f"got {token_id} at position {position}"
                )
        return list(ids)

    def detokenize_ids(self, ids) -> list[int]:
        """Detokenize's ids: at most a context of them (every sequence this engine makes fits
        one), counted before anything reads them."""
        limit = self.limits.max_model_len
        if len(ids) > limit:
            raise _invalid(
                f"token_ids must hold at most {limit} ids (the engine's context), got {len(ids)}"
            )
        return self.token_ids("token_ids", ids, allow_empty=True)

    def chat_prompt(self, chat: pb.ChatMessages) -> Prompt:
        self.need_tokenizer("chat input")
        messages = chat.messages
        if not messages:
            raise _invalid("chat.messages must hold at least one message, got []")
        check_chat_size(chat, self.max_prompt_chars)
        for i, message in enumerate(messages):
            if message.role not in CHAT_ROLES:
                raise _invalid(
                    f"chat.messages[{i}].role must be one of {CHAT_ROLES}, "
                    f"got {_shown(message.role)}"
                )
            if message.reasoning_content and message.role != "assistant":
                raise _invalid(
                    f"chat.messages[{i}].reasoning_content must be empty in a {message.role}'s "
                    f"message (an assistant's thinking), got {_shown(message.reasoning_content)}"
                )
            if message.tool_calls and message.role != "assistant":
                raise _invalid(
                    f"chat.messages[{i}].tool_calls must be empty in a {message.role}'s "
                    f"message (an assistant's calls), got {len(message.tool_calls)}"
                )
        try:
            tools, template_kwargs = chat_tools(chat), chat_template_kwargs(chat)
            turn = chat_turn(chat)
        except ChatInputError as error:
            raise _invalid(str(error)) from None
        try:
            text = render_chat(self.tokenizer, conversation(chat), tools, template_kwargs, *turn)
        except FinalMessageError as error:
            raise _invalid(f"chat.{error}") from None
        except Exception as error:  # noqa: BLE001 - templates raise whatever they like
            raise _invalid(
                f"chat.messages must be accepted by the model's chat template, got an error: "
                f"{error}"
            ) from None
        return Prompt(encode_rendered_chat(self.tokenizer, text), text)

    # ---- sampling ---------------------------------------------------------------------------
    def sampling_params(self, msg: pb.SamplingParams) -> SamplingParams:
        kwargs = {}
        for name in _SAMPLING_FIELDS:
            # Fields with presence (proto3 optional) only when set: unset takes the default.
            if msg.DESCRIPTOR.fields_by_name[name].has_presence and not msg.HasField(name):
                continue
            kwargs[name] = getattr(msg, name)
        if msg.stop:
            kwargs["stop"] = list(msg.stop)
        if msg.stop_token_ids:
            kwargs["stop_token_ids"] = list(msg.stop_token_ids)
        if msg.logit_bias:
            kwargs["logit_bias"] = dict(msg.logit_bias)
        if msg.allowed_token_ids:
            kwargs["allowed_token_ids"] = list(msg.allowed_token_ids)
        if msg.bad_words:
            kwargs["bad_words"] = list(msg.bad_words)
        if msg.HasField("structured_outputs"):
            kwargs["structured_outputs"] = _structured_outputs(msg.structured_outputs)
        if msg.early_stopping not in EARLY_STOPPING:
            names = ", ".join(pb.EarlyStopping.Name(v) for v in EARLY_STOPPING)
            raise _invalid(
                f"sampling.early_stopping must be one of {names}, got {msg.early_stopping}"
            )
        if msg.early_stopping != pb.EARLY_STOPPING_FALSE:
            kwargs["early_stopping"] = EARLY_STOPPING[msg.early_stopping]
        if msg.HasField("beam_width") and not msg.HasField("temperature"):
            kwargs["temperature"] = 0.0  # beam search scores raw logprobs: 0 is its only value
        try:
            params = SamplingParams(**kwargs)  # the model-specific checks are the engine's
        except ValueError as error:
            # SamplingParams names the field in its message already.
            raise _invalid(f"sampling.{error}") from None
        if params.bad_words and self.tokenizer is not None:
            try:
                params.tokenize_bad_words(self.tokenizer)  # (short: at most 128 x 256 chars)
            except ValueError as error:
                raise _invalid(f"sampling.{error}") from None
        return params

    # ---- other RPCs -------------------------------------------------------------------------
    def ttl_s(self, ttl_s: float) -> float:
        if not 0 <= ttl_s <= MAX_TTL_S:
            raise _invalid(f"ttl_s must be in [0, {MAX_TTL_S:.0f}] seconds (0 = no TTL), "
                           f"got {ttl_s}")
        return ttl_s


def _structured_outputs(msg: pb.StructuredOutputs) -> dict:
    """The wire's oneof as StructuredOutputsParams' fields (which check them)."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        names = [f.name for f in msg.DESCRIPTOR.oneofs_by_name["kind"].fields]
        raise _invalid(f"sampling.structured_outputs must set one of {', '.join(names)}, got "
                       f"none of them")
    given = {"resumed_tokens": msg.resumed_tokens}
    given[kind] = list(msg.choice.values) if kind == "choice" else getattr(msg, kind)
    return given
