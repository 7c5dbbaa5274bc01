"""logit_bias through the engine (the offline API on the tiny Llama): a biased request gets its
tokens in a batch with plain greedy ones, which keep the tokens they get alone (a step with any
biased row leaves the all-greedy fast path; the others' rows are untouched), in one step and
when it joins mid-run."""

from __future__ import annotations

import pytest

from engine_service import LLM, SamplingParams

PROMPTS = [[11, 12, 13, 14, 15], [21, 22, 23], [31, 32, 33, 34]]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir, live_llms):
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", block_size=16, num_blocks=64,
              max_model_len=256)
    live_llms.append(llm)
    yield llm
    live_llms.remove(llm)


def _tokens(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_a_forced_and_a_banned_token_beside_plain_greedy_rows(llm):
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = _tokens(llm, PROMPTS, [plain] * 3)
    forced_id = (alone[0][0] + 777) % 40000
    forced = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                            logit_bias={forced_id: 100.0})
    banned = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                            logit_bias={t: -100.0 for t in set(alone[2])})
    mixed = _tokens(llm, PROMPTS, [forced, plain, banned])
    assert mixed[0] == [forced_id] * 8
    assert mixed[1] == alone[1]
    assert not set(mixed[2]) & set(alone[2])


def test_a_small_bias_is_added_not_set(llm):
    """A bias shifts a logit: one just below the margin between the greedy token and the
    runner-up leaves the choice; the greedy token's logprob says the margin."""
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=2)
    [output] = llm.generate([{"prompt_token_ids": PROMPTS[1]}], params)
    [logprob] = output.outputs[0].logprobs
    (best, best_lp), (second, second_lp) = sorted(logprob.top.items(), key=lambda kv: -kv[1])[:2]
    margin = best_lp - second_lp  # the logits' margin: logprobs differ by it too
    biased = [
        _tokens(llm, [PROMPTS[1]], [SamplingParams(temperature=0, max_tokens=1,
                                                   logit_bias={second: margin + delta})])[0][0]
        for delta in (-1e-3, 1e-3)]
    assert biased == [best, second]


def test_allowed_token_ids_hold_the_output_beside_plain_greedy_rows(llm):
    """Greedy among allowed ids is greedy with +100 on each of them (the model's logits
    spread far less): the likeliest allowed token every step; a sampled request draws only
    allowed ids; allowing the greedy tokens changes nothing; neighbours keep their tokens."""
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = _tokens(llm, PROMPTS, [plain] * 3)
    few = [7, 8, 9, 1234]
    restricted = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                allowed_token_ids=few)
    lifted = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                            logit_bias={t: 100.0 for t in few})
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True,
                             allowed_token_ids=few)
    kept = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                          allowed_token_ids=[*alone[0], 5])
    got = _tokens(llm, [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[0]],
                  [restricted, plain, sampled, kept])
    assert got[0] == _tokens(llm, [PROMPTS[0]], [lifted])[0]
    assert set(got[0]) <= set(few) and set(got[2]) <= set(few)
    assert got[1] == alone[1]
    assert got[3] == alone[0]


def test_bad_words_are_never_written(llm):
    """A word the model writes greedily, banned: the output holds none of its tokenizations
    (written alone, or after a space), and goes another way from the first of them."""
    tokenizer = llm.get_tokenizer()
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = _tokens(llm, PROMPTS, [plain] * 3)
    word = tokenizer.decode([alone[0][0]])
    banned = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, bad_words=[word])
    got = _tokens(llm, PROMPTS, [banned, plain, plain])
    assert banned.bad_words_token_ids  # tokenized by the offline API
    for ids in banned.bad_words_token_ids:
        assert not any(tuple(got[0][i:i + len(ids)]) == ids for i in range(len(got[0])))
    assert got[0][0] != alone[0][0]
    assert got[1:] == alone[1:]


def test_min_tokens_gives_way_where_every_allowed_token_stops(llm):
    """The sampler lets a stop token through where it is all allowed_token_ids allow: it ends
    the output (it ran on as text below min_tokens)."""
    for params in (SamplingParams(max_tokens=8, min_tokens=4, allowed_token_ids=[1234],
                                  stop_token_ids=[1234]),
                   SamplingParams(max_tokens=8, min_tokens=4, allowed_token_ids=[2],
                                  skip_special_tokens=False)):
        [out] = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params)
        completion = out.outputs[0]
        assert len(completion.token_ids) == 1 and completion.finish_reason == "stop"
        assert completion.text == ""
    # One allowed token that does not stop: min_tokens holds the stop back as usual.
    [out] = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(
        max_tokens=8, min_tokens=4, allowed_token_ids=[2, 1234], logit_bias={2: 100.0}))
    assert list(out.outputs[0].token_ids) == [1234, 1234, 1234, 1234, 2]
