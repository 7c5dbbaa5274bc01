"""Plain HTTP calls for the endpoints the openai client does not cover (and for raw bodies)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import threading
import urllib.error
import urllib.request

from openai_api.backend import Backend, ServedModel
from openai_api.server import HttpServer


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


async def _texts(ids: list[int]) -> list[str]:
    return [str(i) for i in ids]


@contextlib.contextmanager
def serving(http: HttpServer, servicer, grace_s: float = 0.1):
    """`http` in front of `servicer` (a stand-in: only the methods a test calls), served on an
    event loop of its own; its port. Stopped on exit with `grace_s`."""
    loop = asyncio.new_event_loop()
    backend = Backend(servicer, lambda: True, lambda: [ServedModel("m", 64, 16, 16)], _texts)
    loop.run_until_complete(http.start(backend))
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    try:
        yield http.port
    finally:
        asyncio.run_coroutine_threadsafe(http.stop(grace_s), loop).result(timeout=30 + grace_s)
        loop.call_soon_threadsafe(loop.stop)
        runner.join(timeout=30)
        loop.close()
