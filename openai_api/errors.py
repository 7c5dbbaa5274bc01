"""One error type for the HTTP API, rendered in OpenAI's shape, and the one table from a gRPC
status (what the servicers answer with) to the HTTP status a client of OpenAI's API expects."""

from __future__ import annotations

import re
from dataclasses import dataclass
from http import HTTPStatus

import grpc

# What an OpenAI client does with each: 400 it reports, 401 it never retries, 429 and 503 it
# retries with backoff.
HTTP_STATUS_FOR_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: HTTPStatus.BAD_REQUEST,
    grpc.StatusCode.FAILED_PRECONDITION: HTTPStatus.BAD_REQUEST,
    grpc.StatusCode.OUT_OF_RANGE: HTTPStatus.BAD_REQUEST,
    grpc.StatusCode.UNAUTHENTICATED: HTTPStatus.UNAUTHORIZED,
    grpc.StatusCode.PERMISSION_DENIED: HTTPStatus.FORBIDDEN,
    grpc.StatusCode.NOT_FOUND: HTTPStatus.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS: HTTPStatus.CONFLICT,
    grpc.StatusCode.RESOURCE_EXHAUSTED: HTTPStatus.TOO_MANY_REQUESTS,  # the queue is full
    grpc.StatusCode.UNAVAILABLE: HTTPStatus.SERVICE_UNAVAILABLE,  # draining, no replica
    grpc.StatusCode.DEADLINE_EXCEEDED: HTTPStatus.GATEWAY_TIMEOUT,
    grpc.StatusCode.UNIMPLEMENTED: HTTPStatus.NOT_IMPLEMENTED,
}
ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "invalid_request_error",
    HTTPStatus.UNAUTHORIZED: "authentication_error",
    HTTPStatus.FORBIDDEN: "permission_error",
    HTTPStatus.NOT_FOUND: "not_found_error",
    HTTPStatus.CONFLICT: "conflict_error",
    HTTPStatus.TOO_MANY_REQUESTS: "rate_limit_error",
    HTTPStatus.SERVICE_UNAVAILABLE: "service_unavailable_error",
}
# The field a servicer's message starts with ("sampling.temperature must be ..."); the first
# of two ("sampling.max_tokens and n must fit ...") is the one the client is told to change.
_LEADING_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*) (?:and [\w.]+ )?(must|is|needs)\b")


@dataclass(slots=True)
class ApiError(Exception):
    status: HTTPStatus
    message: str
    param: str | None = None
    code: str | None = None  # OpenAI's machine-readable code ("model_not_found"), or none

    def body(self) -> dict:
        return {"error": {
            "message": self.message,
            "type": ERROR_TYPES.get(self.status, "internal_error" if self.status >= 500
                                    else "invalid_request_error"),
            "param": self.param,
            "code": self.code,  # OpenAI's: a string or null, never the status again
        }}


def bad_request(param: str | None, message: str) -> ApiError:
    return ApiError(HTTPStatus.BAD_REQUEST, message, param)


def from_status(code: grpc.StatusCode, details: str, field_names: dict[str, str]) -> ApiError:
    """The HTTP error for a servicer's refusal; `field_names` maps the wire request's fields
    (sampling.max_tokens, chat.messages, ...) to the names the client sent, so the message
    and `param` name the client's own field."""
    status = HTTP_STATUS_FOR_CODE.get(code, HTTPStatus.INTERNAL_SERVER_ERROR)
    param = None
    match = _LEADING_FIELD.match(details)
    # Any refusal of the client's own input names its field: a 400, and a 403 as well (a
    # tenant's `priority` it may not set).
    if match and HTTPStatus.BAD_REQUEST <= status < HTTPStatus.INTERNAL_SERVER_ERROR:
        wire = match.group(1)
        param = client_field(wire, field_names)
        details = param + details[len(wire):]
    return ApiError(status, details, param, code.name.lower() if status >= 500 else None)


def client_field(wire: str, field_names: dict[str, str]) -> str:
    """`wire` with its longest known prefix renamed: chat.messages[2].role -> messages[2].role,
    sampling.temperature -> temperature."""
    for prefix in sorted(field_names, key=len, reverse=True):
        if wire == prefix or wire.startswith((prefix + ".", prefix + "[")):
            return field_names[prefix] + wire[len(prefix):]
    return wire.removeprefix("sampling.")
