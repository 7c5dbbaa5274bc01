"""A stream still running when the engine's drain grace runs out ends with an error event and
data: [DONE], as any refusal after the first event does; it was cut off mid-body (the client
saw a broken chunked read) and the server logged a RuntimeError from closing the stream's
generator while it still ran."""

from __future__ import annotations

import json
import signal

import httpx2

from tests.http.conftest import start_engine


def test_a_stream_past_the_drain_grace_ends_with_an_error_event(tiny_llama_dir, tmp_path,
                                                                test_certs):
    # A pool for n long sequences: thousands of decode steps, far past the grace of 0 s.
    engine = start_engine(tiny_llama_dir, tmp_path / "engine.log", test_certs,
                          ["--grace-s", "0", "--num-blocks", "4096"])
    body = {"model": engine.model, "prompt": "Hello", "max_tokens": 4000, "n": 16,
            "ignore_eos": True, "stream": True}
    events = []
    try:
        with httpx2.stream("POST", f"{engine.base_url}/v1/completions", json=body,
                           timeout=120, verify=test_certs.ssl_context()) as reply:
            assert reply.status_code == 200
            for line in reply.iter_lines():
                if not line:
                    continue
                events.append(line)
                if len(events) == 5:
                    engine.process.proc.send_signal(signal.SIGTERM)
        assert engine.process.proc.wait(60) == 0
    finally:
        engine.process.kill()
    assert events[-1] == "data: [DONE]", events[-3:]
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["type"] == "service_unavailable_error" and "shutting down" in error["message"]
    assert "RuntimeError" not in engine.log_path.read_text()
