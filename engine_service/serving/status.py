"""Which gRPC status each kind of error becomes: the one table the servicer uses.

The engine raises typed errors (engine_service/core/errors.py); the servicer's own checks of the
wire request raise RequestRejected with a code already chosen. Nothing else picks status codes.
"""

from __future__ import annotations

import math

import grpc

from engine_service.core.errors import (
    DuplicateRequestError,
    EngineDeadError,
    InvalidRequestError,
    QueueFullError,
)
from engine_service.index.link import IndexUnavailableError, PinRefusedError
from engine_service.model.tokenizer import TokenizerNotFoundError

# Most specific first: the first matching type wins.
STATUS_FOR_ERROR: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),  # incl. RequestTooLargeError
    (DuplicateRequestError, grpc.StatusCode.ALREADY_EXISTS),
    (QueueFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (TokenizerNotFoundError, grpc.StatusCode.INVALID_ARGUMENT),
    (EngineDeadError, grpc.StatusCode.INTERNAL),
    (IndexUnavailableError, grpc.StatusCode.UNAVAILABLE),
)
# A refused pin: the index answered, the link is fine.
STATUS_FOR_PIN_REFUSAL = {
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "budget": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "off": grpc.StatusCode.FAILED_PRECONDITION,  # the engine caches no prefixes
}
SAMPLING_FIELDS = frozenset({
    "n", "temperature", "top_k", "top_p", "min_p", "seed", "repetition_penalty",
    "presence_penalty", "frequency_penalty", "max_tokens", "min_tokens", "stop",
    "stop_token_ids", "ignore_eos", "logprobs", "include_stop_str_in_output",
    "skip_special_tokens", "beam_width", "length_penalty", "early_stopping", "logit_bias",
    "structured_outputs", "prompt_logprobs", "allowed_token_ids", "truncate_prompt_tokens",
    "bad_words",
})


class RequestRejected(Exception):
    """A wire request the servicer refuses before the engine sees it: code and message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def status_for(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a client gets for `error`."""
    if isinstance(error, RequestRejected):
        return error.code, error.message
    if isinstance(error, PinRefusedError):
        return STATUS_FOR_PIN_REFUSAL[error.reason], str(error)
    message = str(error)
    field = getattr(error, "field", None)
    if field in SAMPLING_FIELDS and message.startswith(field):
        message = f"sampling.{message}"  # the wire name of the field
    for error_type, code in STATUS_FOR_ERROR:
        if isinstance(error, error_type):
            return code, message
    return grpc.StatusCode.INTERNAL, message


# A call cancelled this close to its deadline was ended by it: the client's deadline timer (its
# cancel looks like any client's, and comes a little before ours, which started when the header
# was read) or gRPC's own timer won the race with the servicer's DEADLINE_EXCEEDED. grpc.aio
# gives 0 left once the deadline passed; 1-2 ms were seen left under load; a header slowed on
# its way (a loaded host, a slow link) leaves its delay. And the server's deadline comes later
# by what the client's gRPC rounded its timeout up by (_wire_rounding_s).
DEADLINE_CANCEL_SLACK_S = 0.25


def _wire_rounding_s(timeout_s: float) -> float:
    """The most gRPC rounds a timeout up by when it sends it (grpc-timeout): to a unit that
    leaves it under 1,000 units (100 ms under 100 s, 1 s under 1,000 s, 10 s under 10,000 s;
    measured)."""
    return 10.0 ** (math.floor(math.log10(timeout_s)) - 2)


def cancel_code(remaining_s: float | None, timeout_s: float | None) -> grpc.StatusCode:
    """How a call its client side ended counts (requests_total): DEADLINE_EXCEEDED when its
    deadline had (all but) passed, else CANCELLED: the client went away. `remaining_s`: its
    time_remaining() then; `timeout_s`: when it arrived. A cancel in the first half of the
    call's time is the client's, however short its deadline."""
    if remaining_s is None or timeout_s is None or timeout_s <= 0:
        return grpc.StatusCode.CANCELLED
    slack_s = min(DEADLINE_CANCEL_SLACK_S + _wire_rounding_s(timeout_s), timeout_s / 2)
    if remaining_s <= slack_s:
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.CANCELLED
