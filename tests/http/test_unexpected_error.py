"""A bug behind the HTTP API (here: a servicer that raises what no servicer should) is still
answered in OpenAI's shape: a 500 with `error`, telling nothing of the exception; a stream that
already sent its status ends with an error event and [DONE]. The server serves on."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.request

import openai
import pytest

from openai_api.backend import Backend, ServedModel
from openai_api.server import HttpServer
from pagedgen_api import generation_pb2 as pb
from tests.http.http_util import call

SECRET = "internal detail /srv/secret-path"


class _BrokenServicer:
    async def Tokenize(self, request, context):  # noqa: N802 - gRPC's method names
        raise RuntimeError(SECRET)

    async def Generate(self, request, context):  # noqa: N802
        raise KeyError(SECRET)

    async def GenerateStream(self, request, context):  # noqa: N802
        if request.sampling.max_tokens == 1:
            raise ValueError(SECRET)  # before the first message: the status is still free
        yield pb.GenerateStreamResponse()  # the status is sent with the first event
        raise ValueError(SECRET)


async def _texts(ids: list[int]) -> list[str]:
    return [str(i) for i in ids]


@pytest.fixture
def broken_server():
    loop = asyncio.new_event_loop()
    server = HttpServer("127.0.0.1", 0)
    backend = Backend(_BrokenServicer(), lambda: True,
                      lambda: [ServedModel("broken", 64, 16, 16)], _texts)
    loop.run_until_complete(server.start(backend))
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    yield f"http://127.0.0.1:{server.port}"
    asyncio.run_coroutine_threadsafe(server.stop(0.1), loop).result(timeout=30)
    loop.call_soon_threadsafe(loop.stop)
    runner.join(timeout=30)
    loop.close()


def _assert_internal(body: dict) -> None:
    error = body["error"]
    assert error["type"] == "internal_error" and error["code"] == "internal_error"
    assert "internal error" in error["message"] and SECRET not in json.dumps(body)


def test_a_bug_is_a_500_in_openais_shape(broken_server):
    status, body = call(f"{broken_server}/tokenize", {"prompt": "Hi"})
    assert status == 500
    _assert_internal(body)
    with openai.OpenAI(base_url=f"{broken_server}/v1", api_key="unused", max_retries=0) as client:
        with pytest.raises(openai.InternalServerError) as raised:
            client.completions.create(model="broken", prompt="Hi", max_tokens=3)
        _assert_internal({"error": raised.value.body})  # the client hands `error` on
        with pytest.raises(openai.InternalServerError):
            client.completions.create(model="broken", prompt="Hi", max_tokens=1, stream=True)
    # The server is unharmed: it still answers.
    assert call(f"{broken_server}/health")[0] == 200


def test_a_bug_mid_stream_ends_with_an_error_event_and_done(broken_server):
    request = urllib.request.Request(
        f"{broken_server}/v1/completions", method="POST",
        data=json.dumps({"model": "broken", "prompt": "Hi", "max_tokens": 3,
                         "stream": True}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200
        events = [line.removeprefix(b"data: ") for line in response.read().split(b"\n\n")
                  if line]
    assert events[-1] == b"[DONE]"
    _assert_internal(json.loads(events[-2]))
