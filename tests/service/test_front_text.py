"""The served engine's text is made in its front (serving/output_text.py: the core sends token
ids only); the offline API's in the engine. Both must give the same completions, stop strings
included: the text cut before the stop string (or through it), the tokens up to the one that
completed it, the finish reason and the string, streamed or not, for every one of n."""

from __future__ import annotations

import pytest

from engine_service import SamplingParams
from pagedgen_api import generation_pb2 as pb
from tests.service.streams import assemble, from_unary

PROMPT = "Once upon a time"


def offline_text(offline_llm, params: SamplingParams) -> str:
    return offline_llm.generate([PROMPT], params)[0].outputs[0].text


def stop_strings(offline_llm) -> list[str]:
    """Two stop strings that occur in the greedy continuation (one early, one later)."""
    text = offline_text(offline_llm, SamplingParams(temperature=0, max_tokens=24))
    early, late = text[len(text) // 4:][:2], text[len(text) // 2:][:3]
    assert early.strip() and late.strip(), f"need visible stop strings in {text!r}"
    return [early, late]


CASES = {
    "greedy": dict(temperature=0),
    "greedy_include_stop": dict(temperature=0, include_stop_str_in_output=True),
    "greedy_min_tokens": dict(temperature=0, min_tokens=6),
    "seeded_n3_logprobs": dict(n=3, temperature=0.9, top_k=20, seed=11, logprobs=2),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_front_text_equals_the_engines(stub, offline_llm, name):
    options = CASES[name]
    stop = stop_strings(offline_llm)
    params = SamplingParams(max_tokens=24, stop=stop, **options)
    [reference] = offline_llm.generate([PROMPT], params)
    request = pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(
        max_tokens=24, stop=stop, **options))
    streamed = assemble(stub.GenerateStream(request, timeout=60))
    unary = from_unary(stub.Generate(request, timeout=60))
    assert streamed.completions == unary
    stopped = 0
    for expected in reference.outputs:
        got = unary[expected.index]
        assert got.text == expected.text
        assert list(got.token_ids) == list(expected.token_ids)
        if expected.finish_reason == "stop" and isinstance(expected.stop_reason, str):
            stopped += 1
            assert got.finish_reason == pb.FINISH_REASON_STOP
            assert got.stop_reason == expected.stop_reason
        if options.get("logprobs"):
            assert [lp.token_id for lp in got.logprobs] == list(got.token_ids)
    # The case is about stop strings: at least one completion ended on one.
    assert stopped >= 1, [(c.finish_reason, c.text) for c in reference.outputs]
