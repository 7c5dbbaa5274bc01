"""Plain HTTP calls for the endpoints the openai client does not cover (and for raw bodies)."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request


def call(url: str, body: dict | bytes | None = None, api_key: str | None = None,
         method: str | None = None, timeout_s: float = 60,
         context: ssl.SSLContext | None = None) -> tuple[int, dict]:
    """(status, JSON body) of one request; error statuses are returned, not raised. `context`:
    the TLS an https URL is called with (one trusting the test CA)."""
    data = body if isinstance(body, bytes | None) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    if api_key is not None:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s, context=context) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())
