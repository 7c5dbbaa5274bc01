"""The connection limits of a Generation server (an engine, or the router in front of engines),
computed from the context it serves (prefix_index/tools/server_options.py applies them)."""

from __future__ import annotations

from engine_service.model.bad_words import MAX_BAD_WORD_CHARS, MAX_BAD_WORDS
from engine_service.model.sampling_params import MAX_ALLOWED_TOKEN_IDS, MAX_LOGPROBS, MAX_N
from engine_service.serving.validation import CHARS_PER_CONTEXT_TOKEN, MAX_CHAT_MESSAGES
from prefix_index.tools.server_options import (
    DEFAULT_MAX_CONNECTION_IDLE_S,
    FIELD_PREFIX_BYTES,
    GENERATION_REQUEST_FIXED_BYTES,
    INT32_BYTES,
    UTF8_MAX_BYTES_PER_CHAR,
    ConnectionLimits,
    capped,
    default_max_connections,
    output_token_bytes,
    prompt_message_bytes,
)

# sampling.allowed_token_ids (packed varints) and bad_words at their largest.
TOKEN_LISTS_BYTES = (FIELD_PREFIX_BYTES + MAX_ALLOWED_TOKEN_IDS * INT32_BYTES
                     + MAX_BAD_WORDS * (FIELD_PREFIX_BYTES
                                        + UTF8_MAX_BYTES_PER_CHAR * MAX_BAD_WORD_CHARS))
# Calls beside generation a client may hold open on one connection with its generations:
# Abort, EngineStats, Tokenize, health checks, a router's polls.
SIDE_CALLS = 64


def generation_request_bytes(context_tokens: int) -> int:
    """The largest GenerateRequest (or Tokenize / PinPrefix / Detokenize request) a server with
    a `context_tokens` context accepts: a whole context's worth of prompt, as text, chat or ids,
    and everything else the validator allows (the largest allowed_token_ids and bad_words
    lists among it)."""
    return capped(prompt_message_bytes(context_tokens, CHARS_PER_CONTEXT_TOKEN, MAX_CHAT_MESSAGES)
                  + GENERATION_REQUEST_FIXED_BYTES + TOKEN_LISTS_BYTES)


def generation_reply_bytes(context_tokens: int) -> int:
    """The largest reply: a unary Generate of MAX_N sequences, each a whole context of tokens
    with MAX_LOGPROBS alternatives a token."""
    per_token = output_token_bytes(CHARS_PER_CONTEXT_TOKEN, MAX_LOGPROBS)
    return capped(MAX_N * context_tokens * per_token + GENERATION_REQUEST_FIXED_BYTES)


def generation_limits(context_tokens: int, max_live_requests: int,
                      max_connections: int | None = None,
                      max_connection_idle_s: float = DEFAULT_MAX_CONNECTION_IDLE_S,
                      ) -> ConnectionLimits:
    """`max_live_requests`: the most generations one client (a router multiplexes all of its
    requests to an engine on one connection) may have open on one connection;
    `max_connections` (None: the default by the open-file limit) and `max_connection_idle_s`:
    the server's --max-connections and --max-connection-idle-s (0: no limit)."""
    return ConnectionLimits(
        max_receive_bytes=generation_request_bytes(context_tokens),
        max_send_bytes=generation_reply_bytes(context_tokens),
        max_streams_per_connection=max_live_requests + SIDE_CALLS,
        max_connections=(default_max_connections() if max_connections is None
                         else max_connections),
        max_connection_idle_s=max_connection_idle_s,
    )
