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
            # Of the tokens sent, not of those the core made past a stop string the front cut.
            total = sum(lp.logprob for lp in got.logprobs)
            assert got.cumulative_logprob == pytest.approx(total, abs=1e-9)
            assert streamed.completions[expected.index].cumulative_logprob == pytest.approx(
                expected.cumulative_logprob, abs=1e-6)
        else:
            assert got.cumulative_logprob is None
    # The case is about stop strings: at least one completion ended on one.
    assert stopped >= 1, [(c.finish_reason, c.text) for c in reference.outputs]


def test_cumulative_logprob_counts_only_the_tokens_kept(offline_llm):
    """A stop string matched in the front cuts the tokens after it, and the core may run one
    more step before it hears: the cumulative logprob sent is of the tokens kept alone."""
    from engine_service.core.outputs import CompletionOutput, RequestOutput
    from engine_service.model.token_logprobs import TokenLogprobs
    from engine_service.serving.output_text import RequestText

    tokenizer = offline_llm.get_tokenizer()
    ids = tokenizer.encode(" one two three four five", add_special_tokens=False)
    words = [tokenizer.decode(ids[: i + 1]) for i in range(len(ids))]
    stop_at = next(i for i, text in enumerate(words) if text.endswith("three"))
    params = SamplingParams(stop=[" three"], logprobs=0)
    finished = []
    text = RequestText(tokenizer, [1], params, lambda index, stop: finished.append(stop))

    def core_output(token_ids: list[int], before: float) -> RequestOutput:
        """What the core sends: its cumulative over every token it made."""
        logprobs = [TokenLogprobs(t, -1.0 - t % 7, {}) for t in token_ids]
        cumulative = before + sum(lp.logprob for lp in logprobs)
        completion = CompletionOutput(0, token_ids_delta=list(token_ids),
                                      logprobs_delta=logprobs, cumulative_logprob=cumulative,
                                      num_tokens=len(token_ids))
        return RequestOutput("r", None, [1], [completion], finished=False)

    first = core_output(ids[: stop_at + 2], 0.0)  # one token past the stop string
    made = first.outputs[0].cumulative_logprob
    text.apply(first)
    sent = first.outputs[0]
    assert finished == [" three"] and sent.token_ids_delta == ids[: stop_at + 1]
    assert sent.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in sent.logprobs_delta))
    assert sent.cumulative_logprob > made  # the cut token's logprob (negative) is out
    late = core_output(ids[stop_at + 2:], made)  # the step the core ran before it heard
    text.apply(late)
    assert late.outputs[0].token_ids_delta == []
    assert late.outputs[0].cumulative_logprob == sent.cumulative_logprob


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_s_text_is_left_out_unless_asked_for(stub, offline_llm, include):
    """A sequence ended by a stop token (stop_token_ids, EOS) keeps the token's id and, as
    vLLM's, not its text: the served front and the offline engine alike, streamed or not,
    with skip_special_tokens off (where EOS's '<|im_end|>' was in the text, as this one's
    was). include_stop_str_in_output keeps it."""
    greedy = offline_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24))
    tokens = greedy[0].outputs[0].token_ids
    stop_id = tokens[len(tokens) // 2]
    options = dict(temperature=0, max_tokens=24, stop_token_ids=[stop_id],
                   skip_special_tokens=False, include_stop_str_in_output=include)
    [reference] = offline_llm.generate([PROMPT], SamplingParams(**options))
    expected = reference.outputs[0]
    assert expected.finish_reason == "stop" and expected.stop_reason == stop_id
    assert expected.token_ids[-1] == stop_id
    stop_text = offline_llm.get_tokenizer().decode([stop_id])
    before = offline_llm.get_tokenizer().decode(expected.token_ids[:-1])
    assert expected.text == (before + stop_text if include else before)
    request = pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(**options))
    streamed = assemble(stub.GenerateStream(request, timeout=60))
    unary = from_unary(stub.Generate(request, timeout=60))
    assert streamed.completions == unary
    assert unary[0].text == expected.text
    assert list(unary[0].token_ids) == list(expected.token_ids)


def test_a_beam_ended_by_a_stop_token_leaves_its_text_out(stub, offline_llm):
    greedy = offline_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24))
    stops = sorted(set(greedy[0].outputs[0].token_ids[2:12]))  # some beam meets one soon
    options = dict(temperature=0, max_tokens=24, n=2, stop_token_ids=stops,
                   skip_special_tokens=False)
    [reference] = offline_llm.generate([PROMPT], SamplingParams(beam_width=2, **options))
    decode = offline_llm.get_tokenizer().decode
    ended = [c for c in reference.outputs if c.finish_reason == "stop"]
    assert ended, [(c.finish_reason, c.text) for c in reference.outputs]
    for c in ended:
        assert c.stop_reason in stops and c.token_ids[-1] in stops
        assert c.text == decode(c.token_ids[:-1])
    request = pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(beam_width=2,
                                                                         **options))
    unary = from_unary(stub.Generate(request, timeout=60))
    assert [unary[c.index].text for c in reference.outputs] == [c.text for c in reference.outputs]
