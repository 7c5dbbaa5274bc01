"""A completions request with a list of prompts runs one engine request per prompt: when one of
them is refused, the whole HTTP request is answered with that error, and the prompts already
running must be aborted, not left generating for nobody."""

from __future__ import annotations

import pytest

from pagedgen_api import generation_pb2 as pb
from tests.http.conftest import API_KEY
from tests.http.test_engine_openai import ABORTED
from tests.service.test_cancel import wait_all_free


@pytest.mark.parametrize("stream", [False, True])
def test_a_refused_prompt_aborts_the_prompts_already_running(http_engine, engine_stub, stream):
    running = 4
    aborted = http_engine.metric(ABORTED)
    # The last prompt's token id is outside the vocabulary: refused after the others started.
    status, body = http_engine.call(f"{http_engine.base_url}/v1/completions", {
        "model": http_engine.model, "prompt": ["Hello there"] * running + [[99_999_999]],
        "max_tokens": 3000, "ignore_eos": True, "stream": stream}, API_KEY)
    assert status == 400 and body["error"]["param"] == f"prompt[{running}]", body
    wait_all_free(engine_stub)
    stats = engine_stub.EngineStats(pb.EngineStatsRequest(), timeout=10)
    assert stats.num_live_requests == 0
    # Ended by the refusal (aborted), not run to their 3000 tokens.
    assert http_engine.metric(ABORTED) == aborted + running


def test_chat_without_max_tokens_and_n_above_one_fits_the_pool(client, http_engine):
    """OpenAI's default max_tokens for chat is the rest of the context; with n sequences it
    must also be what n of them can hold in the KV pool (the engine refuses a request that
    could outgrow it), not a 400 about a max_tokens the client never sent."""
    from tests.service.conftest import BLOCK_SIZE, MAX_MODEL_LEN, NUM_BLOCKS

    assert NUM_BLOCKS * BLOCK_SIZE < 2 * MAX_MODEL_LEN  # two full-context sequences overflow
    reply = client.chat.completions.create(
        model=http_engine.model, messages=[{"role": "user", "content": "Hello"}], n=2)
    assert [c.index for c in reply.choices] == [0, 1]
    assert all(c.finish_reason in ("stop", "length") for c in reply.choices)
