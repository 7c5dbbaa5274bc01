"""API keys for the HTTP API (--api-key / PAGEDGEN_API_KEY), checked in one place: every request
but the probes (/health, /version) needs `Authorization: Bearer <key>` (vLLM's --api-key guards
/v1 alone; here the tokenizer tools and unknown paths are refused too). A later issue extends
this to gRPC and to tenants; the check stays here."""

from __future__ import annotations

import hmac
import os
from http import HTTPStatus

from openai_api.errors import ApiError

API_KEY_ENV = "PAGEDGEN_API_KEY"
# Only the probes stay open: /tokenize and /detokenize answer about the served model too, so an
# unauthenticated caller must get nothing from them but the 401.
OPEN_PATHS = frozenset({"/health", "/version"})


def api_key_from(flag: str | None) -> str | None:
    """--api-key when given, else the environment's; None (no check) when neither is set.
    ValueError for an empty one: an empty Secret or a variable that expanded to nothing must
    not serve an open API its operator meant to close."""
    if flag is not None:
        source, key = "--api-key", flag
    elif API_KEY_ENV in os.environ:
        source, key = API_KEY_ENV, os.environ[API_KEY_ENV]
    else:
        return None
    if not key.strip():
        raise ValueError(f"{source} must be a non-empty key (leave it unset to serve without "
                         f"one), got {key!r}")
    return key


class ApiKeyCheck:
    def __init__(self, api_key: str | None) -> None:
        self._expected = None if api_key is None else api_key.encode()

    def check(self, path: str, authorization: str | None) -> None:
        """Raises a 401 unless the path is open or the header carries the key."""
        if self._expected is None or path in OPEN_PATHS:
            return
        if not authorization:
            raise ApiError(HTTPStatus.UNAUTHORIZED,
                           "this server needs an API key: send Authorization: Bearer <key>",
                           code="invalid_api_key")
        scheme, _, token = authorization.partition(" ")
        # Compared in constant time: a key must not be guessable byte by byte from timings.
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                 self._expected):
            raise ApiError(HTTPStatus.UNAUTHORIZED,
                           "the API key is not valid (Authorization: Bearer <key>)",
                           code="invalid_api_key")
