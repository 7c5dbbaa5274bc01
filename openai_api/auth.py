"""API keys for the HTTP API, checked by tenancy/gate.py as gRPC calls are: every request but
the probes (/health, /version) needs `Authorization: Bearer <key>` (vLLM's --api-key guards /v1
alone; here the tokenizer tools and unknown paths are refused too). --api-key (or
$PAGEDGEN_API_KEY) is the one-key shorthand of --api-key-file (tenancy/cli_args.py)."""

from __future__ import annotations

import os
from http import HTTPStatus

from openai_api.errors import ApiError
from tenancy.gate import OPEN_CALLER, Caller, Gate, Unauthenticated

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
    """The HTTP side of tenancy/gate.py: the same keys and tenants as the gRPC calls."""

    def __init__(self, gate: Gate | None = None) -> None:
        self.gate = gate or Gate(None)

    def check(self, path: str, authorization: str | None) -> Caller:
        """The request's caller; a 401 unless the path is open or the header carries a key."""
        if path in OPEN_PATHS:
            return OPEN_CALLER
        try:
            return self.gate.from_authorization(authorization)
        except Unauthenticated:
            message = ("the API key is not valid (Authorization: Bearer <key>)" if authorization
                       else "this server needs an API key: send Authorization: Bearer <key>")
            raise ApiError(HTTPStatus.UNAUTHORIZED, message, code="invalid_api_key") from None
