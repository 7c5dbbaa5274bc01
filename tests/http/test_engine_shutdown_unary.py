"""A non-streaming request still running when the engine's drain grace runs out is answered
with OpenAI's 503 (`unavailable`: retry), as a stream in that case ends with the 503 error
event; it got uvicorn's plain-text 'Internal Server Error' 500, which an OpenAI client cannot
parse and does not read as the server going away."""

from __future__ import annotations

import signal
import threading
import time

import httpx2

from tests.http.conftest import start_engine


def test_a_request_past_the_drain_grace_gets_a_503_in_openais_shape(tiny_llama_dir, tmp_path,
                                                                    test_certs):
    # A pool for n long sequences: thousands of decode steps, far past the grace of 0 s.
    engine = start_engine(tiny_llama_dir, tmp_path / "engine.log", test_certs,
                          ["--grace-s", "0", "--num-blocks", "4096"])
    body = {"model": engine.model, "prompt": "Hello", "max_tokens": 4000, "n": 16,
            "ignore_eos": True}
    replies = []

    def ask() -> None:
        replies.append(httpx2.post(f"{engine.base_url}/v1/completions", json=body,
                                   timeout=120, verify=test_certs.ssl_context()))

    asker = threading.Thread(target=ask)
    try:
        asker.start()
        time.sleep(3)  # the request is generating (it runs for minutes)
        engine.process.proc.send_signal(signal.SIGTERM)
        asker.join(120)
        assert engine.process.proc.wait(60) == 0
    finally:
        engine.process.kill()
    reply = replies[0]
    assert reply.status_code == 503, reply.text[:200]
    error = reply.json()["error"]
    assert error["type"] == "service_unavailable_error" and error["code"] == "unavailable"
    assert "shutting down" in error["message"] and "retry" in error["message"]
