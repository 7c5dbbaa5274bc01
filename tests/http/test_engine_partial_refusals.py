"""A completions request with a list of prompts runs one engine request per prompt: when one of
them is refused, the whole HTTP request is answered with that error, and the prompts already
running must be aborted, not left generating for nobody."""

from __future__ import annotations

import pytest

from pagedgen_api import generation_pb2 as pb
from tests.http.conftest import API_KEY
from tests.http.http_util import call
from tests.http.test_engine_openai import ABORTED
from tests.service.test_cancel import wait_all_free


@pytest.mark.parametrize("stream", [False, True])
def test_a_refused_prompt_aborts_the_prompts_already_running(http_engine, engine_stub, stream):
    running = 4
    aborted = http_engine.metric(ABORTED)
    # The last prompt's token id is outside the vocabulary: refused after the others started.
    status, body = call(f"{http_engine.base_url}/v1/completions", {
        "model": http_engine.model, "prompt": ["Hello there"] * running + [[99_999_999]],
        "max_tokens": 3000, "ignore_eos": True, "stream": stream}, API_KEY)
    assert status == 400 and body["error"]["param"] == f"prompt[{running}]", body
    wait_all_free(engine_stub)
    stats = engine_stub.EngineStats(pb.EngineStatsRequest(), timeout=10)
    assert stats.num_live_requests == 0
    # Ended by the refusal (aborted), not run to their 3000 tokens.
    assert http_engine.metric(ABORTED) == aborted + running
