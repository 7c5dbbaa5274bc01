"""Text and stop checks on the engine's fast step path (issue 36): a request whose text nobody
reads before its end (final output only, no stop strings) is detokenized at its end, in one
go, and every request's stop check is a set lookup and a comparison until one of its reasons
may hold. Each case runs twice in one batch, as the offline API's request and as a streamed
one: the final outputs must be equal in every field, and the streamed deltas add up to them."""

from engine_service import SamplingParams

CASES = {
    "greedy": SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
    "n2-special": SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=40, ignore_eos=True,
                                 skip_special_tokens=False),
    # stop_token_ids: one of its own later tokens, found by a first run.
    "stop-ids": SamplingParams(temperature=0, max_tokens=80, min_tokens=4),
    "eos": SamplingParams(temperature=1.0, seed=9, max_tokens=80, min_tokens=2),
    "model-length": SamplingParams(temperature=1.0, seed=11, max_tokens=None, ignore_eos=True),
    "stop-string": SamplingParams(temperature=1.0, seed=13, max_tokens=60, stop=["e", "a"]),
    "logprobs": SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=1),
    "penalty": SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                              repetition_penalty=1.3),
}


def _completion_fields(completion) -> tuple:
    return (completion.index, completion.text, completion.token_ids, completion.finish_reason,
            completion.stop_reason, completion.logprobs, completion.num_tokens)


def _prompt(name: str) -> list[int]:
    return [5 + len(name), 40, 41, 42, 43]


def test_deferred_text_equals_streamed_text(make_llm, tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, num_blocks=256, max_model_len=96)
    engine = llm.llm_engine
    probe = CASES["stop-ids"]
    [run] = llm.generate({"prompt_token_ids": _prompt("stop-ids")}, probe)
    tokens = run.outputs[0].token_ids
    probe.stop_token_ids = [tokens[6]]
    for name, params in CASES.items():
        prompt = _prompt(name)
        engine.add_request(f"{name}/final", prompt, params, final_output_only=True)
        engine.add_request(f"{name}/streamed", prompt, params)
    finals, streamed_text = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            name, kind = out.request_id.split("/")
            if kind == "final":
                assert out.finished, "a final-output-only request made an output per step"
            for c in out.outputs:
                key = (name, kind, c.index)
                streamed_text[key] = streamed_text.get(key, "") + c.text_delta
            if out.finished:
                finals[out.request_id] = out
    reasons = set()
    for name in CASES:
        final, streamed = finals[f"{name}/final"], finals[f"{name}/streamed"]
        assert [_completion_fields(c) for c in final.outputs] == \
            [_completion_fields(c) for c in streamed.outputs], name
        for c in streamed.outputs:
            assert streamed_text[(name, "streamed", c.index)] == c.text
            assert streamed_text[(name, "final", c.index)] == c.text
            reasons.add((name, c.finish_reason))
    # The cases reach each way of ending.
    stopped = finals["stop-ids/final"].outputs[0]
    assert stopped.stop_reason == tokens[6]
    assert stopped.token_ids == tokens[: len(stopped.token_ids)]
    assert ("stop-ids", "stop") in reasons and ("model-length", "length") in reasons
    assert ("stop-string", "stop") in reasons and ("greedy", "length") in reasons


def test_aborted_deferred_text_equals_streamed_text(make_llm, tiny_llama_dir):
    """An aborted request's final output has the text of its tokens so far, deferred or not."""
    engine = make_llm(tiny_llama_dir, num_blocks=128).llm_engine
    params = SamplingParams(temperature=1.0, seed=21, n=2, max_tokens=200, ignore_eos=True,
                            skip_special_tokens=False)
    for kind in ("final", "streamed"):
        engine.add_request(kind, [7, 8, 9, 10], params, final_output_only=kind == "final")
    text: dict[int, str] = {}
    for _ in range(25):
        for out in engine.step():
            for c in out.outputs:
                text[c.index] = text.get(c.index, "") + c.text_delta
    final, streamed = engine.abort_request("final"), engine.abort_request("streamed")
    for c in streamed.outputs:
        text[c.index] += c.text_delta
    assert [_completion_fields(c) for c in final.outputs] == \
        [_completion_fields(c) for c in streamed.outputs]
    assert all(c.finish_reason == "abort" and c.num_tokens == 25 for c in final.outputs)
    assert [text[c.index] for c in streamed.outputs] == [c.text for c in final.outputs]
